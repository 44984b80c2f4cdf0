"""Text at the coordinator (the ``text`` extra: transformers, tokenizers): vLLM's
incremental detokenization and stop strings applied by the client, and token-exact
multi-turn conversations. The gateway stays tokens in, tokens out."""

from .conversation import Conversation, Turn
from .detokenizer import TokenDecoder, new_token_decoder
from .sample import SampleText, TextOutput
from .stop_strings import TextParams, check_stop_strings
from .stream import AsyncTextClient, TextClient, TextCompletion, TextStream
from .tokenizer import TextError, TextTokenizer, load_tokenizer

__all__ = [
    "AsyncTextClient",
    "Conversation",
    "SampleText",
    "TextClient",
    "TextCompletion",
    "TextError",
    "TextOutput",
    "TextParams",
    "TextStream",
    "TextTokenizer",
    "TokenDecoder",
    "Turn",
    "check_stop_strings",
    "load_tokenizer",
    "new_token_decoder",
]
