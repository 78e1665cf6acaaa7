"""One module per page the app shows; app/main.py picks which one draws."""
