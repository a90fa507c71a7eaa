"""The completions file: lines appended (and flushed) as sequences finish, so a crash or Ctrl-C
loses nothing finished; put back in input order when the run ends; ``--resume`` skips done ids."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TextIO


class OutputWriter:
    def __init__(self, path: Path, resume: bool) -> None:
        self.path = path
        self.done: set[str] = set()  # json-encoded ids already in the file
        records = self._read() if resume and path.exists() else []
        self.done = {json.dumps(r["id"]) for r in records}
        path.parent.mkdir(parents=True, exist_ok=True)
        # rewrite what survived (drops a line a crash cut short), then append
        self._file: TextIO = path.open("w", encoding="utf-8")
        for r in records:
            self._file.write(json.dumps(r, ensure_ascii=False) + "\n")
        self._file.flush()

    def _read(self) -> list[dict[str, Any]]:
        out = []
        with self.path.open(encoding="utf-8") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a partial last line from an interrupted run
                if isinstance(r, dict) and "id" in r:
                    out.append(r)
        return out

    def is_done(self, request_id: Any) -> bool:
        return json.dumps(request_id) in self.done

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        self.done.add(json.dumps(record["id"]))

    def close(self, order: list[Any]) -> None:
        """Close the file and rewrite it in input order (atomically)."""
        self._file.close()
        rank = {json.dumps(i): n for n, i in enumerate(order)}
        records = sorted(self._read(), key=lambda r: rank.get(json.dumps(r["id"]), len(rank)))
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.replace(tmp, self.path)
