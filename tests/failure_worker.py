"""One rank of a 3-stage pipeline for tests/test_runtime_failures.py (run as a script, one
process per rank, by that test's harness; not a test module itself).

argv: linger ("linger": a rank whose own code failed catches the error and stays alive for
30 s, so only the connections it closes can tell its peers). The fault comes from
TORCHPIPEDREAM_FAULT. Prints one JSON line per rank when fit ends: the exception's type and
message and the wall-clock time it was raised.
"""

from __future__ import annotations

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from torchpipedream.plans.plan import Plan
from torchpipedream.runtime import Pipeline


def main() -> None:
    linger = sys.argv[1:] == ["linger"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    stages = [nn.Linear(4, 8), nn.Sequential(nn.Tanh(), nn.Linear(8, 8)), nn.Sequential(nn.Tanh(), nn.Linear(8, 3))]
    plan = Plan.straight([["a"], ["b"], ["c"]], schedule="pipedream")
    pipe = Pipeline(stages, plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.CrossEntropyLoss(),
                    timeout_s=60, failure_timeout_s=5)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(400)]
    try:
        pipe.fit(data, epochs=1)
        report = {"rank": pipe.rank, "type": None, "message": "", "time": time.time()}
    except Exception as exc:
        report = {"rank": pipe.rank, "type": type(exc).__name__, "message": str(exc), "time": time.time()}
    print("REPORT " + json.dumps(report), flush=True)
    if report["type"] is not None and not report["type"] == "PipelineFailure" and linger:
        time.sleep(30)  # the failed rank stays alive: its peers must not wait for its exit
    sys.exit(1 if report["type"] else 0)


if __name__ == "__main__":
    main()
