"""Files that `isthmus run` puts on a child's PYTHONPATH. Keep them free of isthmus imports."""
