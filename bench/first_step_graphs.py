"""CPU: the graphs of the first forward_backward in the order the H100 runs them (issue 24 item 4).

    BACKEND=aot_eager TORCH_LOGS=dynamo,recompiles PYTHONPATH=src python bench/first_step_graphs.py 2>&1 | grep -E 'start tracing|RESULT'

The memory probe's forwards (CUDA only, emulated here: grad, then grad + block recompute, 100 and 150
tokens), then a step (tiny Qwen3, small GRPO workload, compiled blocks). BACKEND: a dynamo backend in
place of inductor (aot_eager: the same dynamo graphs, no code generation)."""
import os, sys, time, json
import torch
backend = os.environ.get("BACKEND")
if backend:
    _orig = torch.compile
    def _c(fn=None, **kw):
        kw["backend"] = backend
        return _orig(fn, **kw)
    torch.compile = _c
from torch._dynamo.utils import compile_times, counters
from treerl import PrefixTree, TreeEngine
from treerl.engine import memory as M
from treerl.engine.attention import TreeAttention, tree_attention_enabled
from treerl.devtools.benchmark import weighted_logprob_loss
from treerl.devtools.workloads import SCALES, make_workload
from treerl.models import build_model
_est = M.MemoryPolicy._measure
def _measure(self):
    base = self.stack.base
    for n, rec in ((100, False), (150, False), (100, True), (150, True)):
        ids = torch.randint(0, 100, (1, n)); index = torch.arange(n)
        ctx = TreeAttention(self.attention, index, index, torch.full((n,), n)); ctx.mask()
        with torch.enable_grad(), tree_attention_enabled(base, ctx):
            h = self.stack(ids, index[None], checkpoint_blocks=rec)
        del h
    return _est(self)
M.MemoryPolicy._measure = _measure
torch.manual_seed(0)
model = build_model("qwen3", "tiny", dtype=torch.float32, device=torch.device("cpu"), seed=0)
model.train()
engine = TreeEngine(model, compile=True, compile_cache_dir=os.environ.get("CACHE", ""))
tree = PrefixTree.from_sequences(make_workload("grpo", SCALES["small"], model.config.vocab_size))
loss = weighted_logprob_loss(tree)
t = time.perf_counter()
out = engine.forward_backward(tree, loss, separable=True)
first = time.perf_counter() - t
g1 = int(counters["stats"]["unique_graphs"])
ct = compile_times(repr="raw", aggregate=True)
t = time.perf_counter()
engine.forward_backward(tree, loss, separable=True)
second = time.perf_counter() - t
print("RESULT", json.dumps(dict(first=first, second=second, graphs_first=g1, graphs=int(counters["stats"]["unique_graphs"]),
      frames=dict(counters["frames"]), plan=str(engine.stats.plan),
      compile_inner=sum(ct.get("_compile.compile_inner", [0])) if isinstance(ct, dict) else None)))
print(compile_times(repr="str", aggregate=True))
grads = [p.grad.double().sum().item() for p in model.parameters() if p.grad is not None]
print("GRADSUM", repr(sum(grads)), repr(out))
torch.save({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, os.environ.get("GRADS", "/tmp/first_step_grads.pt"))
