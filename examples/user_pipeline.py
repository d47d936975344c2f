"""Your own model and DataLoader with torchpipedream's Pipeline API.

Run it on 2 processes of this computer with torchrun (or across machines with --nnodes):

    torchrun --nproc-per-node 2 examples/user_pipeline.py

Every rank runs this same script. Rank 0 profiles and plans, the plan is shared, and each
rank keeps only its own stage of the model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchpipedream as tpd


def build_model() -> nn.Module:
    torch.manual_seed(0)  # every rank builds the same initial weights
    return nn.Sequential(
        nn.Linear(32, 256), nn.ReLU(),
        nn.Linear(256, 256), nn.ReLU(),
        nn.Linear(256, 4),
    )


def main() -> None:
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 32, generator=gen)
    y = (x[:, :4].argmax(dim=1))  # a learnable 4-class problem
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=False, drop_last=True)

    model = build_model()
    loss_fn = nn.CrossEntropyLoss()
    plan = None
    if dist.get_rank() == 0:  # profile and plan once, then share the plan
        graph = tpd.profile(model, x[:64], loss_fn=loss_fn, target=y[:64])
        plan = tpd.plan(graph, tpd.Topology.local(dist.get_world_size()), straight=True)
    plan = tpd.share_plan(plan, src=0)  # as JSON in a tensor: nothing is unpickled

    pipe = tpd.Pipeline(model, plan, optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
                        loss_fn=loss_fn, schedule="pipedream")
    for epoch in range(3):
        loss = pipe.fit(loader, epochs=1)[0]
        metrics = pipe.evaluate(loader)
        if dist.get_rank() == 0:
            print(f"epoch {epoch + 1}: train loss {loss:.4f}, accuracy {metrics['accuracy']:.3f} "
                  f"[{plan.summary}]", flush=True)
    trace = pipe.trace(dst=0)  # the measured timeline of the last run (collective)
    if dist.get_rank() == 0:
        trace.save("user_pipeline_trace.json")  # torchpipedream timeline user_pipeline_trace.json --out t.png
    # Leave together: a gloo group destroyed while a peer still talks to it can abort that
    # peer ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
