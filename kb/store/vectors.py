"""The Chroma side: embeddings keyed by the same ids as the SQL rows.

Embedded (`PersistentClient` under KB_HOME) by default; `KB_CHROMA_URL`
(`http://host:port`) selects a Chroma server through `HttpClient`. User-info in the URL
(`http://user:password@host:port`) is sent as HTTP basic authentication (Chroma's basic-auth
provider) and never appears in a message.
Invariants: vectors are always supplied by kernel-kb's embedder (collections have no
embedding function); each collection records the embedding model it was built with,
and opening it with another model raises `KBError` instead of mixing vector spaces.
A server that stops answering mid-session raises `KBError` naming it, not a transport
traceback; SQL rows committed before that stay, and `kb doctor --fix` embeds them later.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
import base64
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from kb.errors import KBError
from kb.redact import redact_text, redact_url

__all__ = ["COLLECTIONS", "ChromaTarget", "parse_chroma_url", "VectorStore", "open_vectors"]

log = logging.getLogger(__name__)

COLLECTIONS = ("kernels", "snippets", "lessons")
_PAGE = 5000


@dataclass(frozen=True)
class ChromaTarget:
    """Where the embeddings live: `path` for embedded, else host/port/ssl of a server."""

    path: Path | None = None
    host: str = ""
    port: int = 8000
    ssl: bool = False
    basic_auth: str = field(default="", repr=False)  # "user:password" from the URL's user-info; never displayed

    @property
    def display(self) -> str:
        if self.path is not None:
            return str(self.path)
        return f"{'https' if self.ssl else 'http'}://{self.host}:{self.port}"


def parse_chroma_url(url: str, embedded_dir: Path) -> ChromaTarget:
    """Empty `url`: embedded under `embedded_dir`; `http(s)://host[:port]`: a server."""
    if not url:
        return ChromaTarget(path=embedded_dir)
    full = url if "://" in url else f"http://{url}"
    try:
        parsed = urlparse(full)
        host = parsed.hostname
    except ValueError:  # e.g. an unclosed [IPv6 bracket
        host = None
    if host is None or parsed.scheme not in ("http", "https"):
        raise KBError(f"KB_CHROMA_URL {redact_url(full)} is not an http(s)://host:port URL")
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 8000)
    except ValueError:
        raise KBError(f"KB_CHROMA_URL {redact_url(full)} has an invalid port (a number in 1-65535)") from None
    auth = f"{unquote(parsed.username or '')}:{unquote(parsed.password or '')}" if parsed.username or parsed.password else ""
    return ChromaTarget(host=host, port=port, ssl=parsed.scheme == "https", basic_auth=auth)


def _client(target: ChromaTarget):  # -> chromadb.ClientAPI
    import chromadb
    from chromadb.config import Settings as ChromaSettings

    settings = ChromaSettings(anonymized_telemetry=False)
    try:
        if target.path is not None:
            target.path.mkdir(parents=True, exist_ok=True)
            return chromadb.PersistentClient(path=str(target.path), settings=settings)
        headers = {"Authorization": "Basic " + base64.b64encode(target.basic_auth.encode()).decode()} if target.basic_auth else None
        client = chromadb.HttpClient(host=target.host, port=target.port, ssl=target.ssl, headers=headers, settings=settings)
        client.heartbeat()
        return client
    except OSError as err:
        raise KBError(f"cannot open Chroma at {target.display}: {redact_text(str(err.strerror or err))}", hint="check KB_HOME is writable") from err
    except Exception as err:  # chromadb raises bare Exception/ValueError subclasses for connection failures
        raise KBError(
            f"cannot reach Chroma at {target.display}: {_first_line(err)}",
            hint="start the Chroma server or unset KB_CHROMA_URL to use the embedded store",
        ) from err


class VectorStore:
    """Upsert, delete, list and query embeddings in the kernel-kb collections."""

    def __init__(self, client, target: ChromaTarget, model_name: str) -> None:
        self.target = target
        self.model_name = model_name
        self._client = client
        self._cols = {name: self._collection(name) for name in COLLECTIONS}

    @contextmanager
    def _served(self) -> Iterator[None]:
        """A Chroma server that went away (refused, reset, timed out) becomes one `KBError` naming it."""
        import httpx  # chromadb's HttpClient transport

        try:
            yield
        except httpx.TransportError as err:
            raise KBError(
                f"cannot reach Chroma at {self.target.display}: {_first_line(err)}",
                hint="start the Chroma server; rows already committed to the database stay, and `kb doctor --fix` embeds them",
            ) from err

    def _collection(self, name: str):
        with self._served():
            col = self._client.get_or_create_collection(
                name, metadata={"hnsw:space": "cosine", "embed_model": self.model_name}, embedding_function=None
            )
        built_with = (col.metadata or {}).get("embed_model", self.model_name)
        if built_with != self.model_name:
            raise KBError(
                f"the {name!r} embeddings were built with {built_with!r}, but KB_EMBED_MODEL is {self.model_name!r}",
                hint=f"set KB_EMBED_MODEL={built_with} or rebuild with `kb export` + `kb import` into a fresh KB",
            )
        return col

    def upsert(
        self,
        collection: str,
        ids: Sequence[str],
        embeddings: Sequence[Sequence[float]],
        documents: Sequence[str],
        metadatas: Sequence[Mapping[str, object]],
    ) -> None:
        if ids:
            with self._served():
                self._cols[collection].upsert(
                    ids=list(ids), embeddings=[list(e) for e in embeddings], documents=list(documents),
                    metadatas=[dict(m) for m in metadatas],
                )

    def delete(self, collection: str, ids: Sequence[str]) -> None:
        if ids:
            with self._served():
                self._cols[collection].delete(ids=list(ids))

    def doc_hashes(self, collection: str, ids: Sequence[str] | None = None) -> dict[str, str]:
        """Ids in `collection` (all, or those of `ids` present) with the `doc_hash` in their metadata."""
        col = self._cols[collection]
        out: dict[str, str] = {}
        with self._served():
            if ids is not None:
                for i in range(0, len(ids), _PAGE):
                    _collect(col.get(ids=list(ids[i : i + _PAGE]), include=["metadatas"]), out)
                return out
            offset = 0
            while True:
                page = col.get(include=["metadatas"], limit=_PAGE, offset=offset)
                _collect(page, out)
                if len(page["ids"]) < _PAGE:
                    return out
                offset += _PAGE

    def count(self, collection: str) -> int:
        with self._served():
            return self._cols[collection].count()

    def query(
        self, collection: str, embedding: Sequence[float], k: int, where: Mapping[str, object] | None = None
    ) -> list[tuple[str, float]]:
        """The `k` nearest ids with cosine distance, nearest first."""
        if k <= 0:
            return []
        # no count() first: it costs ~1 ms a call, and Chroma returns fewer than n_results when fewer match
        with self._served():
            res = self._cols[collection].query(query_embeddings=[list(embedding)], n_results=k, where=_where(where),
                                               include=["distances"])
        return list(zip(res["ids"][0], (float(d) for d in res["distances"][0])))


def _first_line(err: BaseException) -> str:
    """An error's first line, credentials redacted (chromadb's messages may quote the URL it tried)."""
    text = str(err).strip()
    return redact_text(text.splitlines()[0]) if text else type(err).__name__


def _collect(page: Mapping, out: dict[str, str]) -> None:
    metas = page.get("metadatas") or [None] * len(page["ids"])
    for id_, meta in zip(page["ids"], metas):
        out[id_] = str((meta or {}).get("doc_hash", ""))


def _where(where: Mapping[str, object] | None) -> dict | None:
    """`{"arch": "sm90", "dtype": "bf16"}` -> Chroma's `$and` form; operator dicts pass through."""
    if not where:
        return None
    if len(where) == 1 or any(k.startswith("$") for k in where):
        return dict(where)
    return {"$and": [{k: v} for k, v in where.items()]}


def open_vectors(url: str, embedded_dir: Path, model_name: str) -> VectorStore:
    target = parse_chroma_url(url, embedded_dir)
    client = _client(target)
    try:
        return VectorStore(client, target, model_name)
    except KBError:
        raise
    except Exception as err:
        raise KBError(f"Chroma at {target.display} is unusable: {_first_line(err)}", hint="move the chroma directory away and run `kb doctor --fix`") from err
