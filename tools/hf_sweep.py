"""Sweep Hugging Face architectures on neuron against CPU eager: what real programs hit.

Each model is built tiny from its config (nothing is downloaded) and run on CPU and on neuron
from the same weights and batch; CPU eager is the oracle. Modes:

* ``train``    one training step: the loss and every parameter's gradient;
* ``compile``  the same with the neuron model under ``torch.compile(backend="neuron")``;
* ``generate`` greedy ``generate()`` with left padding: the tokens must be identical;
* ``replay``   four training steps with dropout on (p = 0.1), compiled on neuron in
  ``mode="reduce-overhead"`` (graphs recorded and replayed, random numbers included) against
  ``mode="default"`` from the same neuron seed: losses and weights must be equal bit for bit
  (the oracle is neuron itself, as dropout's numbers are the device's). Run under
  ``torch.use_deterministic_algorithms(True)``: Inductor's atomic scatter-adds (an embedding's
  backward) otherwise differ in the last bits from run to run, in either mode.

The execution engine is on by default; ``NEURON_LAUNCH_BLOCKING=1`` in the environment sweeps
synchronous kernels, ``TORCH_NEURONX_ENABLE_CONCATENATION=1`` Adaptive Eager. Dropout is switched off (its
random streams differ between devices). Gradients are compared relative to the largest CPU
gradient of each parameter; a parameter whose true gradient is 0 (attention key biases) shows
rounding noise on both sides, so a large relative figure there with a tiny CPU magnitude is not
a bug: ``--verbose`` prints the worst parameters with their magnitudes.

This is a tool for finding bugs, not a test (compiling 40 models takes ~15 minutes on 2 cores);
the bugs it found have their own tests (docs/testing.md).

Usage: ``python tools/hf_sweep.py train gpt2 llama t5:s2s bert:cls`` (``--list`` for the
defaults; ``all`` for every default model of the mode).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import traceback

import torch

VOCAB = 128
_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
# Other names configs use for the same sizes.
_ALIASES = dict(n_embd=64, n_layer=2, n_head=4, d_model=64, num_layers=2, num_heads=4, d_ff=128, d_kv=16,
                encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                encoder_ffn_dim=128, decoder_ffn_dim=128, n_positions=64, ffn_dim=128, n_inner=128,
                num_decoder_layers=2, dim=64, n_heads=4, n_layers=2, hidden_dim=128)
_DROPOUTS = ("dropout", "attention_dropout", "hidden_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop",
             "hidden_dropout_prob", "attention_probs_dropout_prob", "activation_dropout", "dropout_rate",
             "classifier_dropout", "classifier_dropout_prob", "seq_classif_dropout")

DEFAULTS = {
    "train": ("gpt2 gpt_neox opt bloom falcon phi phi3 gemma gemma2 qwen2 mistral olmo stablelm gptj codegen "
              "mpt starcoder2 cohere granite mamba llama t5:s2s bart:s2s mbart:s2s pegasus:s2s bert:cls "
              "roberta:cls distilbert:cls albert:cls electra:cls mpnet:cls big_bird:cls modernbert:cls").split(),
    "generate": "gpt2 llama qwen2 gemma2 phi3 falcon mamba mpt bloom opt t5:s2s bart:s2s".split(),
}
DEFAULTS["compile"] = DEFAULTS["replay"] = DEFAULTS["train"]


def config(model_type: str, dropout: float = 0.0):
    """A tiny config of ``model_type``: two layers, width 64, dropout probabilities ``dropout``."""
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type)
    for key, value in {**_SMALL, **_ALIASES}.items():
        if hasattr(cfg, key) or key == "num_key_value_heads":
            setattr(cfg, key, value)
    if model_type not in ("t5", "mt5", "umt5", "falcon") and getattr(cfg, "head_dim", None) is not None:
        cfg.head_dim = 16
    for key in _DROPOUTS:
        if isinstance(getattr(cfg, key, None), float):
            setattr(cfg, key, dropout)
    if getattr(cfg, "rotary_dim", None) is not None:
        cfg.rotary_dim = 8
    if model_type in ("t5", "mt5", "umt5"):
        cfg.decoder_start_token_id = 0
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        if isinstance(getattr(cfg, key, None), int) and getattr(cfg, key) >= VOCAB:
            setattr(cfg, key, 1)
    return cfg


def build(spec: str, dropout: float = 0.0):
    """``(model, kind)`` for ``type`` (causal LM), ``type:s2s`` or ``type:cls``."""
    import transformers

    model_type, kind = spec.split(":") if ":" in spec else (spec, "causal")
    cfg = config(model_type, dropout)
    if kind == "cls":
        cfg.num_labels = 3
        if getattr(cfg, "pad_token_id", None) is None:
            cfg.pad_token_id = 0
    auto = {"causal": transformers.AutoModelForCausalLM, "s2s": transformers.AutoModelForSeq2SeqLM,
            "cls": transformers.AutoModelForSequenceClassification}[kind]
    torch.manual_seed(0)
    model = auto.from_config(cfg)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = dropout
    return model, kind


def _step(model, kind: str, device: str, compiled: bool, amp: torch.dtype | None = None):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (2, 16), generator=gen)
    labels = torch.tensor([0, 2]) if kind == "cls" else ids
    model = copy.deepcopy(model).to(device).train()
    run = torch.compile(model, backend="neuron") if compiled else model
    with torch.autocast(device, dtype=amp or torch.float32, enabled=amp is not None):
        out = run(input_ids=ids.to(device), labels=labels.to(device))
    out.loss.backward()
    grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach().cpu(), grads


def _gradient_rows(ref: dict, grads: dict) -> list:
    return sorted((((ref[k] - grads[k]).abs().max() / (ref[k].abs().max() + 1e-12)).item(), ref[k].abs().max().item(), k)
                  for k in ref)


def check_train(spec: str, compiled: bool, verbose: bool, amp: torch.dtype | None = None) -> str:
    model, kind = build(spec)
    if compiled:
        torch._dynamo.reset()
    t0 = time.perf_counter()
    loss_cpu, grads_cpu = _step(model, kind, "cpu", False)
    loss_dev, grads_dev = _step(model, kind, "neuron", compiled, amp)
    # AOTAutograd gives zeros where eager leaves .grad None (a parameter the loss does not use,
    # big_bird's pooler); CPU Inductor does the same: only nonzero extras are a difference.
    for k in set(grads_dev) - set(grads_cpu):
        if not grads_dev[k].any():
            del grads_dev[k]
    if set(grads_cpu) != set(grads_dev):
        return f"MISSING GRADIENTS {sorted(set(grads_cpu) ^ set(grads_dev))}"
    rows = _gradient_rows(grads_cpu, grads_dev)
    line = (f"loss diff {(loss_cpu - loss_dev).abs().item():.1e}, worst relative gradient diff "
            f"{rows[-1][0]:.1e} ({rows[-1][2]}, |grad| {rows[-1][1]:.1e}), {time.perf_counter() - t0:.1f} s")
    if amp is not None:
        # The oracle under autocast: CPU fp32, against which CPU's own autocast run shows what
        # error the precision brings. Neuron autocasts CUDA's op lists, CPU its own, so only a
        # neuron error well beyond CPU's is suspect.
        loss_amp, grads_amp = _step(model, kind, "cpu", False, amp)
        ref = max((r for r, m, k in _gradient_rows(grads_cpu, grads_amp) if m > 1e-6), default=0.0)
        mine = max((r for r, m, k in rows if m > 1e-6), default=0.0)
        loss_ref = (loss_cpu - loss_amp).abs().item()
        suspect = mine > max(4 * ref, 0.05) or (loss_cpu - loss_dev).abs().item() > max(4 * loss_ref, 0.02)
        line = (f"{'SUSPECT ' if suspect else ''}loss diff {(loss_cpu - loss_dev).abs().item():.1e} "
                f"(CPU autocast {loss_ref:.1e}), worst gradient {mine:.1e} (CPU autocast {ref:.1e}; "
                f"{rows[-1][2]}), {time.perf_counter() - t0:.1f} s")
    if verbose:
        line += "".join(f"\n      {r:.1e} |grad| {m:.1e} {k}" for r, m, k in rows[-5:])
    return line


def check_replay(spec: str, steps: int = 4) -> str:
    torch.use_deterministic_algorithms(True)
    model, kind = build(spec, dropout=0.1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (2, 16), generator=gen)
    labels = torch.tensor([0, 2]) if kind == "cls" else ids
    runs, counts = {}, {}
    t0 = time.perf_counter()
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        torch.neuron.reset_dynamo_metrics()
        m = copy.deepcopy(model).to("neuron").train()
        run = torch.compile(m, backend="neuron", mode=mode)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        torch.neuron.manual_seed(0)
        losses = []
        for _ in range(steps):
            loss = run(input_ids=ids.to("neuron"), labels=labels.to("neuron")).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        runs[mode] = (torch.stack(losses).cpu(), [p.detach().cpu() for p in m.parameters()])
        counts[mode] = torch.neuron.get_dynamo_metrics()
    c = counts["reduce-overhead"]
    line = (f"{c['graphs_recorded']} graphs recorded, {c['graph_replays']} replays, "
            f"{c['graphs_not_recordable']} not recordable, {time.perf_counter() - t0:.1f} s")
    same = torch.equal(runs["default"][0], runs["reduce-overhead"][0]) and all(
        torch.equal(a, b) for a, b in zip(runs["default"][1], runs["reduce-overhead"][1]))
    if not same:
        worst = max(((a - b).abs().max() / (a.abs().max() + 1e-12)).item()
                    for a, b in zip(runs["default"][1], runs["reduce-overhead"][1]))
        return (f"DIFFERENT from default mode: losses {runs['default'][0].tolist()} vs "
                f"{runs['reduce-overhead'][0].tolist()}, worst relative weight diff {worst:.1e}; {line}")
    return f"equal to default mode bit for bit; {line}"


def check_generate(spec: str, compiled: bool, static: bool = False) -> str:
    model, kind = build(spec)
    model.eval()
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    tokens = {}
    for device in ("cpu", "neuron"):
        m = copy.deepcopy(model).to(device)
        if compiled and device == "neuron":
            torch._dynamo.reset()
            m.forward = torch.compile(m.forward, backend="neuron")
        with torch.no_grad():
            # A static cache makes transformers compile the forward itself on neuron (as on CUDA:
            # its CompileConfig, Inductor in "reduce-overhead" mode); CPU generates eagerly.
            extra = dict(cache_implementation="static") if static else {}
            tokens[device] = m.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                        max_new_tokens=8, do_sample=False, pad_token_id=0, **extra).cpu()
    if torch.equal(tokens["cpu"], tokens["neuron"]):
        return "same tokens"
    return f"DIFFERENT TOKENS\n      cpu    {tokens['cpu'].tolist()}\n      neuron {tokens['neuron'].tolist()}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("train", "compile", "generate", "replay"))
    parser.add_argument("models", nargs="*", help="model types (type, type:s2s, type:cls) or 'all'")
    parser.add_argument("--compiled-forward", action="store_true", help="generate: compile the neuron forward")
    parser.add_argument("--static-cache", action="store_true", help="generate: with a static KV cache, "
                        "which transformers compiles on neuron")
    parser.add_argument("--amp", choices=("bf16", "fp16"), help="train/compile: the neuron step under autocast, "
                        "judged against CPU fp32 and CPU's own autocast error")
    parser.add_argument("--list", action="store_true", help="print the default models of the mode")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_intermixed_args(argv)
    import torchneuron  # noqa: F401  (registers the device)

    if args.list:
        print(" ".join(DEFAULTS[args.mode]))
        return 0
    specs = DEFAULTS[args.mode] if args.models in ([], ["all"]) else args.models
    failures = 0
    for spec in specs:
        try:
            if args.mode == "generate":
                result = check_generate(spec, args.compiled_forward, args.static_cache)
            elif args.mode == "replay":
                result = check_replay(spec)
            else:
                amp = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.amp]
                result = check_train(spec, args.mode == "compile", args.verbose, amp)
        except Exception as exc:  # report and go on: the sweep's point is the whole picture
            result = f"ERROR {type(exc).__name__}: {str(exc)[:400]}"
            if args.verbose:
                result += "\n" + traceback.format_exc()
        failures += result.startswith(("ERROR", "DIFFERENT", "MISSING", "SUSPECT"))
        print(f"{spec:16s} {result}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
