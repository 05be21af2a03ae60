"""Character-level tokenizer built locally with the ``tokenizers`` library (no model hub).

Every character of the alphabet is one token; three special tokens come first:
``<pad>`` = 0, ``<eos>`` = 1, ``<bos>`` = 2. Encoding a text prepends ``<bos>`` (the template
post-processor) so a prompt always starts from the same state; decoding fuses the characters
back without the spaces WordLevel decoding would otherwise insert.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, BOS, UNK)

#: Enough for chain_sum prompts in the compact format ("12+3-45=") and their answers.
DEFAULT_ALPHABET = "0123456789+-="


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """Build a character-level ``PreTrainedTokenizerFast`` over ``alphabet``.

    Args:
        alphabet: the characters the tokenizer knows, each one token, in id order after the
            special tokens. Duplicates are dropped; characters outside it map to ``<unk>``.

    Returns:
        A fast tokenizer with ``pad_token``/``eos_token``/``bos_token`` set, left padding (what
        batched decoder-only generation needs) and ``add_special_tokens=True`` adding ``<bos>``.
        Save it with ``save_pretrained(dir)`` next to the model checkpoint.
    """
    chars = list(dict.fromkeys(alphabet))
    if any(c in SPECIAL_TOKENS for c in chars):
        raise ValueError("alphabet must hold single characters, not special tokens")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in chars:
        vocab[c] = len(vocab)

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every single character is its own "word".
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
