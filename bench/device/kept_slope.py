"""What a lone recomputing call really holds per kept attention (issue 24, the root split's memory).

Runs long_prefix (one 43,485-token call, Qwen3-1.7B shape, bf16) with a forced number of kept
attention layers, root split on and off, and prints the measured activation peak per count beside
the memory model's terms (the plan's spare, the lone call's margin, the modelled bytes per kept
layer): the intercept is the call's real need, the slope what a kept layer really holds.
"""
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import long_trees as lt  # noqa: E402
from treerl import PrefixTree  # noqa: E402
from treerl.devtools.benchmark import time_forward_backward, weighted_logprob_loss  # noqa: E402
from treerl.devtools.workloads import SCALES, make_workload  # noqa: E402
from treerl.engine.memory import root_split_layer_bytes  # noqa: E402
from treerl.engine.rooted_trees import rooted_trees  # noqa: E402
from treerl.models import build_model  # noqa: E402

device = torch.device("cuda")
model = build_model("qwen3", "qwen3-1.7b", dtype=torch.bfloat16, device=device, seed=0)
model.train()
for p in model.parameters():
    p.grad = torch.zeros_like(p)
tree = PrefixTree.from_sequences(make_workload("long_prefix", SCALES["paper"], model.config.vocab_size))
loss = weighted_logprob_loss(tree)
n = tree.num_tree_tokens
roots = rooted_trees(tree.subtree_end, 0)
rows = []
for config, counts in (("auto-root", (0, 8, 16)), ("auto", (0, 28))):
    for k in counts:
        engine = lt.make_engine(model, config, None)
        m = engine.memory.model
        layers = engine.memory.layers
        chosen = {}
        original = engine.memory.kept_attention_layers

        def forced(*a, _k=k, _orig=original, **kw):
            chosen["model"] = len(_orig(*a, **kw))
            chosen["args"] = (a[:3], kw.get("alone"), kw.get("roots"), float(a[3]) / 2**30)
            return frozenset(range(layers - _k, layers))

        engine.memory.kept_attention_layers = forced
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(device)
        with lt.switches(config):
            s, _, peak = time_forward_backward(engine, tree, loss, 1, 1)
        row = dict(config=config, kept=k, seconds=s, activation_gib=(peak - base) / 2**30,
                   peak_gib=peak / 2**30, budget_gib=engine.memory.budget / 2**30,
                   model_would_keep=chosen.get("model"), kept_args=str(chosen.get("args")),
                   margin_gib=m.recompute_margin(n) / 2**30, plan_peak_gib=engine.plan(tree).peak_bytes / 2**30,
                   root_layer_gib=root_split_layer_bytes(m, n, roots) / 2**30,
                   mask_layer_gib=n * m.attention_per_query / 2**30, routes=dict(engine.stats.attention))
        rows.append(row)
        print(json.dumps(row), flush=True)
        model.zero_grad(set_to_none=False)
        del engine
        torch.cuda.empty_cache()
Path(os.environ.get("OUT", "."), "kept_slope_s10.json").write_text(json.dumps(rows, indent=1))
