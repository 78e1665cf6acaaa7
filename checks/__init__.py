"""Exactness checks shared by the tests and the scripts (which never import the tests): tiny
random-weight models (models.py), greedy runs traced with their logits and compared with a
near-tie rule (greedy.py), and pinning the GEMV kernel's configuration (kernels.py)."""
