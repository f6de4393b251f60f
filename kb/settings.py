"""All settings in one place, read from env (`KB_*`), an optional config file, and flags.

Precedence: explicit overrides > environment > `$KB_HOME/config.toml` > defaults.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kb.errors import KBError
from kb.redact import MASK, redact_url

__all__ = ["Settings", "load_settings", "default_home"]


def default_home() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "kernel-kb"


@dataclass(frozen=True)
class Settings:
    home: Path = field(default_factory=default_home)
    db_url: str = ""  # empty: sqlite file under home
    chroma_url: str = ""  # empty: embedded PersistentClient under home
    embed_model: str = "all-MiniLM-L6-v2"
    embed_batch: int = 64
    llm_base_url: str = ""
    llm_model: str = ""
    llm_api_key: str = ""
    llm_temperature: float = 0.2
    llm_timeout_s: float = 60.0
    llm_max_attempts: int = 3
    verify_timeout: float = 600.0  # seconds: `kb verify`'s limit on the candidate; `kb generate`'s budget per spec
    target_arch: str = "sm90"  # the GPU `kb generate --target auto` designs for when this machine has none
    service_url: str = ""  # a `kb serve` to send query/show/stats to (http://host:port); empty: this process opens the KB
    service_token: str = ""  # the bearer token `kb serve` requires (and clients send); required beyond loopback

    def __repr__(self) -> str:
        """Every setting, with credentials hidden (URLs redacted, the API key masked)."""
        def shown(name: str, value: object) -> object:
            if name in ("llm_api_key", "service_token"):
                return MASK if value else ""
            return redact_url(value) if name.endswith("_url") and isinstance(value, str) and value else value
        return f"Settings({', '.join(f'{f.name}={shown(f.name, getattr(self, f.name))!r}' for f in fields(self))})"

    def __post_init__(self) -> None:
        if not self.verify_timeout > 0:  # also refuses NaN
            raise KBError(f"verify timeout must be a positive number of seconds (--timeout or KB_VERIFY_TIMEOUT), "
                          f"not {self.verify_timeout!r}")

    @property
    def resolved_db_url(self) -> str:
        return self.db_url or f"sqlite:///{self.home / 'kb.sqlite'}"

    @property
    def chroma_dir(self) -> Path:
        return self.home / "chroma"

    @property
    def cache_dir(self) -> Path:
        return Path(os.environ.get("KB_CACHE_DIR") or (self.home / "cache"))


_ENV = {f.name: "KB_" + f.name.upper() for f in fields(Settings)}


def _coerce(name: str, raw: Any) -> Path | int | float | str:  # raw: what TOML, the env or a caller gave
    typ = {f.name: f.type for f in fields(Settings)}[name]
    try:
        if typ in ("Path", Path):
            return Path(str(raw)).expanduser()
        if typ in ("int", int):
            return int(raw)
        if typ in ("float", float):
            return float(raw)
    except ValueError as err:
        raise KBError(f"setting {name}={raw!r} is not a valid {typ}") from err
    return str(raw)


def load_settings(**overrides: object) -> Settings:
    """Settings from defaults, `$KB_HOME/config.toml`, `KB_*` env vars and `overrides` (None = unset)."""
    values: dict[str, object] = {}
    home = Path(str(overrides.get("home") or os.environ.get("KB_HOME") or default_home())).expanduser()
    config = home / "config.toml"
    if config.is_file():
        try:
            data = tomllib.loads(config.read_text())
        except tomllib.TOMLDecodeError as err:
            raise KBError(f"{config} is not valid TOML: {err}") from err
        unknown = set(data) - set(_ENV)
        if unknown:
            raise KBError(f"{config}: unknown settings {sorted(unknown)}; known: {sorted(_ENV)}")
        values.update(data)
    for name, env in _ENV.items():
        if env in os.environ:
            values[name] = os.environ[env]
    values.update({k: v for k, v in overrides.items() if v is not None})
    values["home"] = home
    coerced: dict[str, Any] = {k: _coerce(k, v) for k, v in values.items()}  # each of its field's type
    return replace(Settings(), **coerced)
