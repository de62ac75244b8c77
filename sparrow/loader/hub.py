"""A model name as the engine takes it, resolved to a checkpoint directory: an existing
directory as is, a Hugging Face Hub id (`owner/name`) through the Hub's cache, downloading
what is missing (`huggingface_hub.snapshot_download`), None as the built-in default.

The Hub's settings are read when a name is resolved: `HF_HUB_CACHE` (else `HF_HOME/hub`),
`HF_HUB_OFFLINE` (the cache only, nothing downloaded) and `HF_TOKEN` (gated and private
repos). Only the files Sparrow reads are downloaded (`ENGINE_FILES`, `TOKENIZER_FILES`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from sparrow.assets import default_checkpoint

logger = logging.getLogger(__name__)

ENGINE_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
)
# the tokenizer, chat template and media preprocessing: what the gateway reads
TOKENIZER_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)
_TRUE = {"1", "ON", "YES", "TRUE"}


class ModelNotFoundError(ValueError):
    """A model name that is neither a checkpoint directory nor a Hub id whose snapshot
    can be had (not cached offline, unknown to the Hub, a revision it lacks, gated)."""


def resolve_model(
    name: str | Path | None,
    revision: str | None = None,
    download_dir: str | Path | None = None,
    *,
    weights: bool = True,
) -> Path:
    """The checkpoint directory `name` names: the built-in default for None, an existing
    directory as is, else the snapshot of the Hub repo `owner/name` at `revision` (a branch,
    tag or commit; None: main) in the Hub's cache, or in `download_dir` when given (as
    vLLM's `--download-dir`). `weights` False: the tokenizer, template and preprocessing
    files only. ModelNotFoundError says why a name resolves to nothing."""
    if name is None:
        return default_checkpoint()
    if Path(name).is_dir():
        return Path(name)
    name = str(name)
    if not is_repo_id(name):
        raise ModelNotFoundError(
            f"model {name!r}: no such directory, and not a Hugging Face Hub id (owner/name)"
        )
    cache = hub_cache(download_dir)
    patterns = [*ENGINE_FILES, *TOKENIZER_FILES] if weights else list(TOKENIZER_FILES)
    path = _snapshot(name, revision, cache, sorted(set(patterns)))
    logger.info("model %s (revision %s): %s", name, revision or "main", path)
    return path


def is_repo_id(name: str) -> bool:
    """Whether `name` is a valid Hub model id of the form `owner/name`."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_cache(download_dir: str | Path | None = None) -> Path:
    """Where Hub snapshots are kept: `download_dir`, else `HF_HUB_CACHE`, else `HF_HOME/hub`
    (default `~/.cache/huggingface/hub`). Read from the environment on each call, since
    `huggingface_hub` reads it once, when imported."""
    if download_dir is not None:
        return Path(download_dir).expanduser()
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    xdg = env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    home = env.get("HF_HOME") or os.path.join(xdg, "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """Whether `HF_HUB_OFFLINE` forbids downloads (read on each call, as `hub_cache`)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    return constants.HF_HUB_OFFLINE if value is None else value.upper() in _TRUE


def _snapshot(name: str, revision: str | None, cache: Path, patterns: list[str]) -> Path:
    """snapshot_download's directory, its errors turned into ModelNotFoundError."""
    import huggingface_hub
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = hub_offline()
    at = f" at revision {revision!r}" if revision else ""
    try:
        path = huggingface_hub.snapshot_download(
            name,
            revision=revision,
            cache_dir=cache,
            local_files_only=offline,
            allow_patterns=patterns,
        )
    except LocalEntryNotFoundError as e:
        if offline:
            raise ModelNotFoundError(
                f"model {name!r}{at} is not (or only in part) in the Hugging Face cache "
                f"{cache}, and HF_HUB_OFFLINE is set, so nothing is downloaded: unset "
                "HF_HUB_OFFLINE to download it, or give a checkpoint directory"
            ) from e
        cause = e.__cause__ or e
        raise ModelNotFoundError(
            f"model {name!r}{at}: the Hugging Face Hub cannot be reached "
            f"({type(cause).__name__}: {cause}) and the cache {cache} does not hold it"
        ) from e
    except GatedRepoError as e:
        raise ModelNotFoundError(
            f"model {name!r} is gated on the Hugging Face Hub: accept its terms there and "
            "set HF_TOKEN to a token of that account"
        ) from e
    except RepositoryNotFoundError as e:
        raise ModelNotFoundError(
            f"model {name!r}: no such directory, and no such repo on the Hugging Face Hub "
            "(a private one needs HF_TOKEN)"
        ) from e
    except RevisionNotFoundError as e:
        raise ModelNotFoundError(
            f"model {name!r} has no revision {revision!r} on the Hugging Face Hub"
        ) from e
    except HfHubHTTPError as e:
        raise ModelNotFoundError(f"model {name!r}{at}: the Hugging Face Hub answered {e}") from e
    return Path(path)
