"""One tree's cells of its own benchmarks/routing_bench.py, timed by the process's CPU time, one JSON line per cell
(run7-redesign/README.md): run once per tree and policy, alternating the trees, with the tree on PYTHONPATH.

    PYTHONPATH=TREE python routing_ab.py TREE POLICY REQUESTS REPEAT
"""

import functools
import json
import sys
import time
import timeit
import types

tree, policy, requests, repeat = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, tree + "/benchmarks")
import routing_bench as rb  # noqa: E402

import appliance  # noqa: E402

assert appliance.__file__.startswith(tree), appliance.__file__
# the process's CPU time, not the wall clock: on a loaded host the wall clock counts the time others ran
rb.timeit = types.SimpleNamespace(repeat=functools.partial(timeit.repeat, timer=time.process_time))  # type: ignore[assignment]
for prompt in ("text-44", "ids-2000"):
    for name, rules in rb.RULES.items():
        for n in (1, 16):
            for d in (1, 8):
                us = rb.us_per_request(policy, rules, prompt, n, d, requests, repeat)
                print(json.dumps({"policy": policy, "prompt": prompt, "rules": name, "inst": n, "dp": d, "us": us,
                                  "timer": "cpu"}), flush=True)
