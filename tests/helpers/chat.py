"""Tiny chat tokenizers (byte-level BPE trained here, saved as a transformers tokenizer directory) with
three chat templates: ChatML with ``{% generation %}`` markers, ChatML without, and Llama-3's."""

from __future__ import annotations

import json
from pathlib import Path

CHATML_GEN = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
              "{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
          "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
TEMPLATES = {"chatml-generation": (CHATML_GEN, "<|im_end|>"), "chatml": (CHATML, "<|im_end|>"),
             "llama3": (LLAMA3, "<|eot_id|>")}
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]
TEXT = ("hello world, how are you? I am fine thank you. what is two plus two? it is four. tell me a story about a "
        "cat who sat on a mat. user assistant system") * 4


def chat_tokenizer(directory: Path, template: str | None = "chatml") -> str:
    """Save a tokenizer (vocab < 256 + specials) with ``template`` (a key of TEMPLATES, or None)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    eos = TEMPLATES[template][1] if template else "<|endoftext|>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>", unk_token="<unk>",
                                   bos_token="<|begin_of_text|>")
    if template:
        fast.chat_template = TEMPLATES[template][0]
    fast.save_pretrained(str(directory))
    return str(directory)


CONVERSATIONS = [
    [{"role": "system", "content": "you are a cat"}, {"role": "user", "content": "how are you?"},
     {"role": "assistant", "content": "I am fine"}, {"role": "user", "content": "what is two plus two?"},
     {"role": "assistant", "content": "it is four"}],
    [{"role": "user", "content": "tell me a story"}, {"role": "assistant", "content": "a cat sat on a mat"}],
]


def write_jsonl(path: Path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)
