"""A phase timer for a live isthmus server and its workers (see sitecustomize.py)."""
