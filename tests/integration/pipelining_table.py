"""Print the schedule x form table of docs/guide/pipelining.md for the installed torch.

    python tests/integration/pipelining_table.py        # 2 and 4 ranks
    python tests/integration/pipelining_table.py 4      # 4 ranks only

Every remat form and torch's own checkpoint forms under every pipeline schedule, at 2 and 4
gloo ranks (``test_pipelining.print_table``). The ranks import ``test_pipelining`` by name,
so it is imported here, not run as ``__main__``.
"""

import sys
from pathlib import Path

if __name__ == "__main__":  # (pytest --doctest-modules imports this file: nothing runs then)
    sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

    import test_pipelining

    test_pipelining.print_table(tuple(int(world) for world in sys.argv[1:]) or (2, 4))
