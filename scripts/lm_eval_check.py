"""lm-evaluation-harness against ``treerl serve``: a loglikelihood (multiple-choice) task
and a generate_until task from a local JSONL file (``scripts/lm_eval_tasks/``), with
``local-completions``, its remote tokenizer (``/tokenizer_info``, ``/tokenize``,
``/detokenize``) and ``batch_size`` 4 (several token-id prompts per request).

The server runs in this process (a tiny random-weight Qwen3 on the CPU, float32, with a
byte-level BPE tokenizer built locally: :func:`treerl.tasks.bpe.tiny_bpe_tokenizer`);
``lm_eval`` runs as a subprocess from its own virtual environment, because its
dependencies (datasets, pandas, pyarrow, scipy, scikit-learn, nltk, sacrebleu, evaluate,
...: 72 packages, ~760 MB installed for lm-eval 0.4.13; it needs neither torch nor
transformers) are too heavy for treerl's CI and the shared dev environment::

    python3 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install "lm-eval[api]"   # once (lm-eval 0.4.13 tested)
    PYTHONPATH=src .venv/bin/python scripts/lm_eval_check.py --lm-eval /tmp/lmeval/bin/lm_eval

It checks that both tasks ran on every document (random weights: the scores are chance;
what is checked is that the harness's requests are served), and that the loglikelihoods
lm-eval computed equal the model's own (a teacher-forced forward per document).
Exit status 0 when every check passes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "scripts" / "lm_eval_tasks"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lm-eval", default="/tmp/lmeval/bin/lm_eval", help="the lm_eval command of its own venv")
    ap.add_argument("--batch-size", type=int, default=4)
    args = ap.parse_args(argv)

    from treerl.models import build_model
    from treerl.rollout import RolloutEngine
    from treerl.serve import ServeOptions, ServerThread, make_state
    from treerl.tasks.bpe import tiny_bpe_tokenizer

    tok = tiny_bpe_tokenizer()
    model = build_model("qwen3", "tiny", seed=0, vocab_size=len(tok), max_position_embeddings=256,
                        eos_token_id=tok.eos_token_id, bos_token_id=None, pad_token_id=tok.pad_token_id)
    engine = RolloutEngine(model)
    server = ServerThread(make_state(engine, tok, ServeOptions(default_max_tokens=16))).start()
    try:
        with tempfile.TemporaryDirectory() as out:
            cmd = [args.lm_eval, "run", "--model", "local-completions", "--tasks", "treerl_arith_mc", "treerl_arith_gen",
                   "--include_path", str(TASKS), "--batch_size", str(args.batch_size), "--log_samples",
                   "--output_path", out, "--model_args",
                   f"base_url={server.url}/completions,model=treerl,tokenizer_backend=remote,"
                   f"tokenized_requests=True,max_length=200,num_concurrent=2,max_retries=1"]
            env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OPENAI_API_KEY="x",
                       PYTHONPATH="")
            print("+", " ".join(cmd), flush=True)
            run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
            print(run.stdout[-4000:])
            if run.returncode != 0:
                print(run.stderr[-6000:], file=sys.stderr)
                print(f"FAIL: lm_eval exited with {run.returncode}")
                return 1
            results = sorted(Path(out).rglob("results_*.json"))
            samples = {t: sorted(Path(out).rglob(f"samples_{t}_*.jsonl")) for t in ("treerl_arith_mc", "treerl_arith_gen")}
            res = json.loads(results[-1].read_text())["results"]
            server.state.loop.drain()
            http = server.state.metrics.http_responses.labels("/v1/completions", "200")._value.get()
            prompts = server.state.loop.stats.requests
            print(f"{int(http)} completions requests carried {prompts} prompts")
            ok = prompts > http
            if not ok:
                print("FAIL: no request carried several prompts (batch_size > 1)")
            return check(res, {t: [json.loads(line) for line in p[-1].read_text().splitlines()]
                               for t, p in samples.items()}, engine, tok, ok)
    finally:
        server.stop()


def check(results: dict, samples: dict, engine, tok, ok: bool = True) -> int:
    docs = [json.loads(line) for line in (TASKS / "arith.jsonl").read_text().splitlines()]
    mc, gen = results["treerl_arith_mc"], results["treerl_arith_gen"]
    print(f"treerl_arith_mc: acc {mc['acc,none']:.3f}   treerl_arith_gen: exact_match "
          f"{gen['exact_match,remove_whitespace' if 'exact_match,remove_whitespace' in gen else 'exact_match,none']:.3f}")
    if len(samples["treerl_arith_mc"]) != len(docs) or len(samples["treerl_arith_gen"]) != len(docs):
        print("FAIL: not every document was evaluated")
        ok = False
    worst = 0.0
    for s in samples["treerl_arith_mc"]:
        doc = s["doc"]
        context = tok.encode(f"Question: {doc['question']}\nAnswer:", add_special_tokens=False)
        for choice, resp in zip(doc["choices"], s["resps"]):
            cont = tok.encode(f" {choice}", add_special_tokens=False)
            ids = context + cont
            with torch.no_grad():
                logp = torch.log_softmax(engine.model(torch.tensor([ids])).logits[0].double(), -1)
            ref = float(logp[len(context) - 1 : -1].gather(1, torch.tensor(cont)[:, None]).sum())
            got = float(resp[0][0])
            worst = max(worst, abs(got - ref) / max(1.0, abs(ref)))
    print(f"loglikelihoods vs a teacher-forced forward: worst relative difference {worst:.2e}")
    if worst > 1e-4:  # float32 model: the server's batched forward and this one round differently
        print("FAIL: loglikelihoods differ from the model's")
        ok = False
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
