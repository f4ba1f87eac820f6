# No mpi4py or torch import here: vLLM's spawned engine processes re-import this module.
import sys

from hpcrl.compute.launch.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
