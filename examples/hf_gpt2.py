"""A Hugging Face GPT-2 (random weights, nothing downloaded) trained with pipeline parallelism.

    pip install '.[hf]'        # transformers, pinned
    torchrun --nproc-per-node 2 examples/hf_gpt2.py

What it shows: a model nobody here wrote, that torch.fx cannot trace (torch.export does, on the
sample batch given to Pipeline); batches as the model takes them (a dict of keyword arguments);
the model's own loss (``labels=``, no loss_fn); and its tied input embedding and output layer,
which the plan puts on different stages: each holds a copy, kept bit-identical.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import torchpipedream as tpd
from torchpipedream.models import VOCAB_SIZE, text_data


def build_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)  # every rank builds the same initial weights
    config = GPT2Config(vocab_size=VOCAB_SIZE, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                        use_cache=False,  # the key/value cache is for generation; export cannot return it
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def main() -> None:
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    torch.set_num_threads(1)
    x, _, x_val, _ = text_data(context=64, max_bytes=40_000)  # windows of Python's own sources
    batches = [{"input_ids": x[i:i + 16], "labels": x[i:i + 16]} for i in range(0, 16 * 20, 16)]
    validation = [{"input_ids": x_val[:32], "labels": x_val[:32]}]

    model = build_model()
    plan = None
    if dist.get_rank() == 0:  # profile and plan once, then share the plan
        graph = tpd.profile(model, batches[0])
        plan = tpd.plan(graph, tpd.Topology.local(dist.get_world_size()), straight=True)
        print(plan.table(), flush=True)  # ends with the shared parameter and its stages
    plan = tpd.share_plan(plan, src=0)

    pipe = tpd.Pipeline(model, plan, optimizer=lambda params: torch.optim.Adam(params, lr=3e-3),
                        sample=batches[0], schedule="pipedream")
    for epoch in range(3):
        losses = pipe.train_minibatches(batches)
        metrics = pipe.evaluate(validation)
        if dist.get_rank() == 0:
            print(f"epoch {epoch + 1}: train loss {sum(losses) / len(losses):.4f}, "
                  f"validation loss {metrics['loss']:.4f}", flush=True)
    state = pipe.state_dict(dst=0)  # the model's own keys, both names of the tied matrix included
    if dist.get_rank() == 0:
        assert torch.equal(state["transformer.wte.weight"], state["lm_head.weight"])
        print("tied copies identical; state keys match the model:", sorted(state) == sorted(model.state_dict()))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
