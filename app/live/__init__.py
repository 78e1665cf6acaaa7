"""Live charts drawn in the browser from new steps only (see component.py)."""
