"""Secret redaction for everything this project publishes: MLflow parameters and tags, Prefect
artifacts and logs.

    redact({"trainer.hf_token": "hf_abc…", "data.prompt_key": "question",
            "trainer.tracking_uri": "https://ann:pw@mlflow.example/"})
    == {"trainer.hf_token": "***", "data.prompt_key": "question",
        "trainer.tracking_uri": "https://ann:***@mlflow.example/"}

Two rules, applied to every entry of a flat ``{dotted.key: value}`` mapping:

1. **By name.** A key whose last dotted part names a secret is replaced whole by ``"***"``: a part
   containing secret / password / passwd / pwd / credential(s) / apikey / authorization, or ending in
   token / auth (``hf_token``, ``access_token``, ``auth``), or ending in key after api / access /
   secret / private / signing / encryption / ssh / master (``api_key``, ``AWS_SECRET_ACCESS_KEY``).
   Words are split on ``_ - .`` and camelCase, so ``apiKey`` is caught while ``data.prompt_key``,
   ``answer_key``, ``max_token_len_per_gpu`` and ``generation_batch_tokens`` are kept: masking the
   config's ordinary keys would make the recorded runs useless for comparison.
2. **By value.** Text that looks like a credential wherever it appears (a command line, a URL, an
   override string like ``"trainer.token=hf_…"``) is masked in place: Hugging Face (``hf_…``),
   OpenAI-style (``sk-…``), GitHub (``ghp_…``, ``github_pat_…``), Slack (``xox?-…``), AWS access key
   ids (``AKIA…``), JWTs, ``Bearer …`` headers, the password of ``scheme://user:password@host``,
   ``key=value`` / ``key: value`` pairs whose key names a secret, and long random-looking strings
   (32+ characters mixing upper case, lower case and digits, ≥ 4 bits per character, changing
   character class as often as random text does — hashes, run ids, paths and model names are kept).

Inline data (``data:<type>;base64,<payload>``, the learning curve in a Prefect report) is kept as
it is: its payload is random-looking by nature, and masking parts of it would break the image.

Numbers, booleans and None are never secrets by value (a key rule still masks them). Lists, tuples
and nested dicts are redacted element by element. The function returns a new dict and never raises.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any, Mapping

MASK = "***"

_SECRET_WORDS = {"secret", "secrets", "password", "passwd", "pwd", "credential", "credentials", "apikey",
                 "authorization", "passphrase"}
_SECRET_LAST_WORDS = {"token", "auth"}
_KEY_QUALIFIERS = {"api", "access", "secret", "private", "signing", "encryption", "ssh", "master", "client"}

_VALUE_PATTERNS = [
    re.compile(r"\bhf_[A-Za-z0-9]{20,}"),                        # Hugging Face token
    re.compile(r"\bsk-[A-Za-z0-9_\-]{16,}"),                     # OpenAI-style API key
    re.compile(r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{20,}"),   # GitHub tokens
    re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}"),
    re.compile(r"\bxox[abprs]-[A-Za-z0-9\-]{10,}"),              # Slack
    re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),                # AWS access key id
    re.compile(r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"),  # JWT
]
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/\-]{8,}=*")
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^\s/:@]*:)(?P<password>[^\s/@]+)(?P<at>@)")
_ASSIGNMENT = re.compile(r"(?P<key>[A-Za-z_][A-Za-z0-9_.\-]*)(?P<sep>\s*[=:]\s*['\"]?)(?P<value>[^\s,;&'\"]+)")
_LONG_RUN = re.compile(r"[A-Za-z0-9+/_\-]{32,}={0,2}")
_DATA_URI = re.compile(r"\bdata:[\w.+\-]+/[\w.+\-]+;base64,[A-Za-z0-9+/]+=*")


def _words(name: str) -> list[str]:
    """'AWS_SECRET_ACCESS_KEY' → [aws, secret, access, key]; 'apiKey' → [api, key]."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name)
    return [w for w in re.split(r"[^A-Za-z0-9]+", spaced.lower()) if w]


def is_secret_key(key: str) -> bool:
    """Whether the last dotted part of ``key`` names a secret (see the module docstring)."""
    words = _words(str(key).rsplit(".", 1)[-1])
    if not words:
        return False
    if any(w in _SECRET_WORDS for w in words) or words[-1] in _SECRET_LAST_WORDS:
        return True
    if words[-1] in ("key", "keys"):
        return len(words) == 1 or words[-2] in _KEY_QUALIFIERS
    return False


def _char_class(c: str) -> int:
    return 0 if c.isupper() else 1 if c.islower() else 2 if c.isdigit() else 3


def _high_entropy(text: str) -> bool:
    """A random key rather than a name: upper, lower and digits all present, ≥ 4 bits per character,
    and the character class changing between ≥ 40 % of neighbouring letters/digits. Random
    alphanumerics change class ~62 % of the time; names such as
    ``Qwen2-0_5B-Instruct-GPTQ-Int4-AWQ-Finetuned-v2`` (as high in entropy) ≤ 37 %; hex digests and
    run ids have no upper case. A heuristic backstop to the name and format rules (measured: it
    catches ~99 % of random 32-character keys)."""
    if not (any(c.isupper() for c in text) and any(c.islower() for c in text) and any(c.isdigit() for c in text)):
        return False
    counts = Counter(text)
    entropy = -sum(n / len(text) * math.log2(n / len(text)) for n in counts.values())
    alnum = [c for c in text if c.isalnum()]
    changes = sum(_char_class(a) != _char_class(b) for a, b in zip(alnum, alnum[1:]))
    return entropy >= 4.0 and changes >= 0.4 * (len(alnum) - 1)


def _mask_assignment(match: re.Match) -> str:
    value = match.group("value")
    if is_secret_key(match.group("key")) and value != MASK and value.lower() not in ("bearer", "basic"):
        return f"{match.group('key')}{match.group('sep')}{MASK}"
    return match.group(0)


def redact_text(text: str) -> str:
    """``text`` with every credential-looking part replaced by ``***`` (see the module docstring);
    inline base64 data kept whole."""
    if "base64," not in text:
        return _redact_plain(text)
    out, start = [], 0
    for match in _DATA_URI.finditer(text):
        out += [_redact_plain(text[start:match.start()]), match.group(0)]
        start = match.end()
    return "".join(out + [_redact_plain(text[start:])])


def _redact_plain(text: str) -> str:
    for pattern in _VALUE_PATTERNS:
        text = pattern.sub(MASK, text)
    text = _BEARER.sub(lambda m: f"{m.group(1)} {MASK}", text)
    text = _URL_PASSWORD.sub(lambda m: f"{m.group('head')}{MASK}{m.group('at')}", text)
    text = _ASSIGNMENT.sub(_mask_assignment, text)
    return _LONG_RUN.sub(lambda m: MASK if _high_entropy(m.group(0)) else m.group(0), text)


def redact_value(value: Any) -> Any:
    """A value with secret-looking text masked; containers element by element."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, Mapping):
        return redact(value)
    if isinstance(value, (list, tuple)):
        return type(value)(redact_value(v) for v in value)
    return value


def redact(flat_params: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``flat_params`` safe to publish: values under secret-naming keys become ``"***"``,
    other values have credential-looking text masked. Keys are kept as they are."""
    return {key: MASK if is_secret_key(str(key)) and value not in (None, "") else redact_value(value)
            for key, value in flat_params.items()}
