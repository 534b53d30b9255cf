"""SmolLM2-135M loaded once per session: the transformers oracle and our model on the same weights."""
import pytest

from engine_adapter.loader import from_transformers, load_hf_gguf


@pytest.fixture(scope="session")
def smollm2():
    """(transformers model, our model, tokenizer)."""
    hf, tokenizer = load_hf_gguf()
    return hf, from_transformers(hf, name="HuggingFaceTB/SmolLM2-135M-Instruct"), tokenizer
