"""End-to-end runs of scripts/ at tiny sizes."""
