import json
import os

import pytest

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_tiny_model(path, max_position_embeddings: int = 256) -> str:
    """A byte-level BPE tokenizer with a chat template and a config.json: all that planning reads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["the quick brown fox jumps over the lazy dog", "write a poem about the sea", "hello world"] * 50
    tok.train_from_iterator(text, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(str(path))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "max_position_embeddings": max_position_embeddings}, f)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the session (2 CPUs, no dashboard, no auth)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
