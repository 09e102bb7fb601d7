import os
import sys

# Keep each test process (and every spawned rank) to one thread: the suite runs several gloo ranks
# on two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))
