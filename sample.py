"""Continue a prompt with a train_gpt.py checkpoint's weights (GPT-2 BPE through tiktoken), as nanoGPT's sample.py does:

    python sample.py --init_from=logs/run.pt --prompt="The history of" [--tokens=64] [--temperature=0.8] [--seed=0]
                     [--device=cuda]

The model, and the windows and rotary tables its run last validated with, come from the checkpoint. A whole forward
per added token over the zero-padded text (no key-value cache): a look at what a model learned, not a fast sampler.
"""
import dataclasses
import sys

import numpy as np
import torch

import train_gpt as tg

# name: (kind, default); None: required
OPTIONS = {"init_from": ("str", None), "prompt": ("str", None), "tokens": ("int", 64), "temperature": ("float", 0.8),
           "seed": ("int", 0), "device": ("str", "cuda")}


def parse(argv: list[str]) -> dict:
    options = {name: default for name, (_, default) in OPTIONS.items()}
    for arg in argv:
        name, equals, text = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or not equals or name not in OPTIONS:
            raise tg.UserError(f"{arg!r}: sample.py takes " + ", ".join(f"--{name}=..." for name in OPTIONS))
        try:
            options[name] = tg.parse_value(name, OPTIONS[name][0], text)
        except ValueError as e:
            raise tg.UserError(f"bad value for --{name}: {text!r} ({e or 'a ' + OPTIONS[name][0]})") from None
    missing = [f"--{name}" for name, value in options.items() if value is None]
    if missing:
        raise tg.UserError(f"sample.py needs {' and '.join(missing)} (python sample.py --init_from=CHECKPOINT "
                           "--prompt=TEXT)")
    if options["tokens"] < 1 or options["temperature"] < 0:
        raise tg.UserError(f"--tokens={options['tokens']} and --temperature={options['temperature']}: at least 1, "
                           "and 0 (greedy) or more")
    if options["device"] not in ("cuda", "cpu"):
        raise tg.UserError(f"--device={options['device']}: use cuda or cpu")
    if options["device"] == "cuda" and not torch.cuda.is_available():
        raise tg.UserError(tg.NO_CUDA)
    return options


def gpt2_encoding():
    try:
        import tiktoken
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # no package, no network, no cached files
        raise tg.UserError(f"sample.py needs tiktoken's gpt2 encoding, which did not load ({type(e).__name__}): "
                           "pip install tiktoken; offline, see data/tokenize_text.py's help") from None


@torch.no_grad()
def generate(model: tg.GPT, cfg: tg.Config, prompt: list[int], windows: tuple[int, int], count: int,
             temperature: float, seed: int, device: torch.device) -> list[int]:
    """Up to `count` tokens after `prompt`, to a BOS: a forward per token over the zero-padded text."""
    length = cfg.micro_batch_tokens
    slot = tg._Slot(length, False, cfg.bos_token, cfg.bigram_rows)
    generator = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    while len(tokens) < min(len(prompt) + count, length):
        window = np.zeros(length + 1, dtype=np.int64)
        window[: len(tokens)] = tokens
        slot.fill([window])
        inputs = slot.inputs.to(device)
        masks = model.prepare_masks(inputs, slot.cu_seqlens.to(device), windows, slot.documents, slot.longest_document)
        bigrams = slot.bigrams.to(device) if cfg.bigram_rows else None
        logits = model(inputs, None, masks, bigrams)[len(tokens) - 1, : cfg.vocab_size].float().cpu()
        token = int(logits.argmax()) if temperature == 0 else int(
            torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator))
        tokens.append(token)
        if token == cfg.bos_token:
            break
    return tokens[len(prompt):]


def sample(options: dict, log=print, codec=None) -> str:
    """The prompt continued by the checkpoint's weights; codec: (encode, decode), GPT-2's by default."""
    if codec is None:  # before the checkpoint is read: a missing tiktoken fails at once
        encoding = gpt2_encoding()
        codec = (encoding.encode_ordinary, encoding.decode)
    encode, decode = codec
    checkpoint = tg.read_checkpoint(options["init_from"], "init_from")
    cfg = dataclasses.replace(tg.config_from_dict(checkpoint["config"]), device=options["device"],
                              forward_micro_batches=1, seed=options["seed"], init_from=options["init_from"])
    tg.check_same_model(checkpoint, cfg, "init_from")  # a model setting this code lacks: refused
    prompt = [cfg.bos_token] + list(encode(options["prompt"]))
    if max(prompt) >= cfg.vocab_size:
        raise tg.UserError(f"--prompt: its tokens go up to {max(prompt)}, outside the model's vocabulary "
                           f"({cfg.vocab_size} tokens)")
    if len(prompt) >= cfg.micro_batch_tokens:
        raise tg.UserError(f"--prompt: {len(prompt)} tokens, the model reads at most {cfg.micro_batch_tokens - 1}")
    model, device, _ = tg.build_model(cfg, tg.Comm(), lambda line: None)
    tg.load_checkpoint_weights(model, checkpoint)
    windows = tg.set_up_as_validated(model, checkpoint)
    added = generate(model, cfg, prompt, windows, options["tokens"], options["temperature"], cfg.seed, device)
    text = decode([t for t in added if t != cfg.bos_token])
    log(f"sample (temperature {options['temperature']}, seed {cfg.seed}): {options['prompt']!r} -> {text!r}")
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return 0
    try:
        sample(parse(argv))
        return 0
    except tg.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
