"""Shared by the chat tests: a small byte-level BPE tokenizer made here (no download) in a Hugging Face folder
with a real chat template, ChatML with {% generation %} blocks (Qwen's) or Llama-3's without, and conversations."""
import json
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]

# ChatML as Qwen2.5 writes it (system prompt, tools, tool calls and responses), the assistant's content and its
# <|im_end|> inside {% generation %} (as TRL's training templates mark them), the newline after it outside
CHATML = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('a system message must come first') }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
            {%- if message.content %}
                {{- message.content }}
            {%- endif %}
            {%- for tool_call in message.tool_calls or [] %}
                {{- '<tool_call>\\n{"name": "' + tool_call.function.name + '", "arguments": ' }}
                {{- tool_call.function.arguments | tojson + '}\\n</tool_call>' }}
            {%- endfor %}
            {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama-3's template (Meta-Llama-3-8B-Instruct), without generation blocks
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
          "{% endif %}")

CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "What is 2 + 2?"},
                  {"role": "assistant", "content": "4."},
                  {"role": "user", "content": "And 3 + 3?"},
                  {"role": "assistant", "content": "6, of course."}]},
    {"messages": [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."}]},
    {"messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "",
                   "tool_calls": [{"type": "function", "function": {"name": "weather",
                                                                    "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "content": "sunny, 21 C"},
                  {"role": "assistant", "content": "Sunny and 21 degrees."}],
     "tools": [{"type": "function", "function": {"name": "weather", "description": "today's weather",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}]},
    {"messages": [{"role": "user", "content": "Say héllo in Greek, then count: one two three four five."},
                  {"role": "assistant", "content": "Γειά σου! one two three four five"}]},
]


def make_tokenizer(folder: Path, template: str = CHATML, bos: str = "<|begin_of_text|>",
                   eos: str = "<|im_end|>") -> Path:
    """A byte-level BPE (a few hundred merges learned from the conversations) with the ChatML and Llama-3
    special tokens, saved with tokenizer_config.json (its chat template, BOS and EOS) as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m.get("content") or "" for c in CONVERSATIONS for m in c["messages"]] * 3
    texts += ["user assistant system tool_call tool_response arguments name weather function Tools\n\n"] * 5
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "pad_token": "<|endoftext|>", "chat_template": template, "model_max_length": 4096,
              "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def write_conversations(prefix: Path, count: int = 48, vocab: int = 120, seed: int = 0, longest: int = 40,
                        shortest: int = 3) -> str:
    """A dataset of `count` synthetic conversations (token ids below `vocab`) and its loss mask, as
    tools/preprocess_data.py --chat writes them: turns of prompt (no loss) and answer (loss), of random lengths
    from `shortest` to `longest` tokens in all, each counting up from a random token (quickly learnt). Returns
    the dataset prefix."""
    import numpy as np

    from megalysses.data.indexed import IndexedDatasetBuilder, loss_mask_prefix

    rng = np.random.default_rng(seed)
    prefix = str(prefix)
    tokens = IndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    mask = IndexedDatasetBuilder(f"{loss_mask_prefix(prefix)}.bin", np.uint8)
    for _ in range(count):
        n = int(rng.integers(shortest, longest + 1))
        turns = np.sort(rng.choice(np.arange(1, n), size=min(n - 1, int(rng.integers(1, 4))), replace=False))
        answer = (np.searchsorted(turns, np.arange(n), side="right") % 2).astype(np.uint8)
        tokens.add_document((rng.integers(0, vocab) + np.arange(n)) % vocab)     # counting: quickly learnt
        mask.add_document(answer)
    tokens.finalize(f"{prefix}.idx")
    mask.finalize(f"{loss_mask_prefix(prefix)}.idx")
    return prefix
