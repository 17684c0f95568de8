"""How fast the pure rank math is for large worlds (run by hand: `make bench`).

Prints, per world size, the time to build every group kind of both views, every rank's
coordinates and the placement plan, next to the ~1 s budget a CLI answer should stay under.
"""

import argparse
import time

from service.spec.placement import plan_placement
from workers.grid import DECODER_KINDS, EXPERT_KINDS, ParallelGrid


def main():
    argparse.ArgumentParser(prog="python -m bench.grid_bench", description=__doc__.split("\n\n")[0]).parse_args()
    print(f"{'world':>7} {'layout':<34} {'groups s':>9} {'coords s':>9} {'plan s':>8}")
    for world, kw in [
        (1024, dict(tp=8, pp=4, cp=2, ep=4, etp=1)),
        (4096, dict(tp=8, pp=8, cp=2, ep=8, etp=1)),
        (16384, dict(tp=8, pp=8, cp=2, ep=8, etp=1)),
        (16384, dict(tp=4, pp=16, cp=4, ep=4, order="tp-dp-cp-ep-pp")),
    ]:
        g = ParallelGrid(world, **kw)
        t0 = time.perf_counter()
        for k in DECODER_KINDS:
            g.groups(k)
        for k in EXPERT_KINDS:
            g.groups(k, expert=True)
        t1 = time.perf_counter()
        for r in range(world):
            g.coords(r)
        t2 = time.perf_counter()
        plan_placement(g, 8)
        t3 = time.perf_counter()
        layout = " ".join(f"{k}{v}" for k, v in g.sizes().items())
        print(f"{world:>7} {layout:<34} {t1 - t0:>9.3f} {t2 - t1:>9.3f} {t3 - t2:>8.3f}")


if __name__ == "__main__":
    main()
