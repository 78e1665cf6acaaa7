"""`python -m bench`: the list of benchmarks (each is `python -m bench.<name> --help`)."""

import bench

print(bench.__doc__)
