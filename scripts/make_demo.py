"""Generate the bundled demo data and (re)train the bundled demo tokenizer.

    python scripts/make_demo.py data --output demo/chat.jsonl [--num-samples 4000] [--seed 0] [--kind chat|text]
    python scripts/make_demo.py tokenizer [--output thdpack/demo/tokenizer] [--vocab-size 3072]
    python scripts/make_demo.py omni --output demo/omni [--num-samples 24] [--seed 0]

``data`` writes seeded synthetic rows (see ``thdpack/demo/synthetic.py``) as JSON Lines;
``configs/demo.yaml`` does not need the file (it generates the same rows in memory),
but other tools and tests can read it.

``omni`` writes the omni demo (``thdpack/demo/omni_demo.py``: generated tones, rows with ``<audio>`` markers, a
tokenizer with the thinker's tokens, a feature extractor, a tiny thinker config and ``build.yaml``).

``tokenizer`` trains a byte-level BPE tokenizer with the ``tokenizers`` library on
generated chat and text rows and writes ``tokenizer.json`` and
``tokenizer_config.json`` (Qwen-style special tokens and chat template, with
``{% generation %}`` markers so assistant tokens can be found exactly). The files in
the repository were made with the defaults; running it again reproduces them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from thdpack.demo import generate_rows, iter_texts, write_jsonl  # noqa: E402

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen-style ChatML. The assistant's content and its closing <|im_end|> are wrapped in
# {% generation %} so `apply_chat_template(..., return_assistant_tokens_mask=True)` and
# thdpack find exactly the tokens to train on.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(output: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rows = generate_rows(4000, seed=0, kind="chat") + generate_rows(2000, seed=1, kind="text")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_texts(rows), trainer=trainer)
    output.mkdir(parents=True, exist_ok=True)
    tok.save(str(output / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "chat_template": CHAT_TEMPLATE,
    }
    (output / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {output}/tokenizer.json and tokenizer_config.json (vocab {tok.get_vocab_size()})")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data", help="write seeded synthetic rows as JSON Lines")
    d.add_argument("--output", required=True, type=Path)
    d.add_argument("--num-samples", type=int, default=4000)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--kind", choices=["chat", "text"], default="chat")
    t = sub.add_parser("tokenizer", help="train the demo tokenizer")
    t.add_argument("--output", type=Path, default=ROOT / "thdpack" / "demo" / "tokenizer")
    t.add_argument("--vocab-size", type=int, default=3072)
    o = sub.add_parser("omni", help="write the omni demo (audio rows, its build.yaml)")
    o.add_argument("--output", required=True, type=Path)
    o.add_argument("--num-samples", type=int, default=24)
    o.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.cmd == "omni":
        from thdpack.demo.omni_demo import write_omni_demo

        config = write_omni_demo(args.output, args.num_samples, args.seed)
        print(f"wrote the omni demo; build it with thdpack build --config {config}")
    elif args.cmd == "data":
        path = write_jsonl(generate_rows(args.num_samples, args.seed, args.kind), args.output)
        print(f"wrote {args.num_samples} {args.kind} rows to {path}")
    else:
        train_tokenizer(args.output, args.vocab_size)


if __name__ == "__main__":
    main()
