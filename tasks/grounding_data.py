"""Temporal-grounding datasets read as they are distributed (docs/algorithms.md §8).

Every reader returns examples as dicts:

    {"qid": str, "vid": str, "query": str, "duration": float, "windows": [[s, e], ...] | None}

(`windows` is None for unlabeled splits such as the QVHighlights test set.) A malformed line raises
`DatasetError` naming file:line and the expected format; with `on_error="skip"` it is counted instead and the
count is logged and kept in `SKIPPED[path]`.

    Charades-STA      charades_sta_{train,test}.txt: `VIDEOID START END##sentence`, durations from
                      Charades_v1_{train,test}.csv (columns `id`, `length`)
    ActivityNet Cap.  {train,val_1,val_2}.json: {video_id: {"duration", "timestamps": [[s, e], ...],
                      "sentences": [...]}}, one example per (timestamp, sentence)
    QVHighlights      highlight_{train,val,test}_release.jsonl: one JSON object per line with `qid`, `query`,
                      `duration`, `vid`, `relevant_windows` (absent in test)
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os

from mmrl.errors import ConfigError, MissingFile

log = logging.getLogger(__name__)
SKIPPED: dict[str, int] = {}
VIDEO_EXTENSIONS = (".mp4", ".mkv", ".webm", ".avi", ".mov")


class DatasetError(ConfigError):
    """A malformed record of the user's dataset file (path:line in the message); a ValueError, as before."""


class _Errors:
    """Raise at the first bad record, or count bad records (on_error="skip")."""

    def __init__(self, path: str, on_error: str):
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.path, self.on_error, self.count = path, on_error, 0

    def __call__(self, where, msg: str) -> None:
        text = f"{self.path}:{where}: {msg}"
        if self.on_error == "raise":
            raise DatasetError(text + " (fix the record, or pass on_error='skip' to count and skip bad records)")
        self.count += 1
        log.warning("skipped %s", text)

    def done(self) -> None:
        SKIPPED[self.path] = self.count
        if self.count:
            log.warning("%s: %d malformed records skipped", self.path, self.count)


def _window(s, e, duration) -> list[float] | None:
    try:
        s, e = float(s), float(e)
    except (TypeError, ValueError):
        return None
    if not (math.isfinite(s) and math.isfinite(e)) or s < 0 or e < s:
        return None
    return [s, min(e, duration)] if duration else [s, e]


def read_charades_durations(csv_path: str) -> dict[str, float]:
    """{video id: length in seconds} from Charades_v1_{train,test}.csv."""
    with open(csv_path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = {"id", "length"} - set(reader.fieldnames or ())
        if missing:
            raise DatasetError(f"{csv_path}:1: missing column(s) {sorted(missing)}; a Charades_v1 csv has 'id' "
                               f"and 'length' columns")
        out = {}
        for i, row in enumerate(reader, start=2):
            try:
                out[row["id"]] = float(row["length"])
            except (TypeError, ValueError):
                raise DatasetError(f"{csv_path}:{i}: length {row.get('length')!r} is not a number") from None
    return out


def read_charades_sta(txt_path: str, durations: str | dict[str, float], on_error: str = "raise") -> list[dict]:
    """Charades-STA queries; `durations` is the Charades_v1 csv path or a {video id: seconds} dict."""
    lengths = read_charades_durations(durations) if isinstance(durations, str) else durations
    err, out = _Errors(txt_path, on_error), []
    with open(txt_path, encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            head, sep, query = line.partition("##")
            parts = head.split()
            if not sep or len(parts) != 3 or not query.strip():
                err(i, f"expected 'VIDEOID START END##sentence', got {line!r}")
                continue
            vid, s, e = parts
            if vid not in lengths:
                err(i, f"video {vid!r} has no duration in the Charades_v1 csv")
                continue
            w = _window(s, e, lengths[vid])
            if w is None:
                err(i, f"bad interval {s!r} {e!r} (need 0 <= START <= END, numbers)")
                continue
            out.append({"qid": f"{vid}#{i}", "vid": vid, "query": query.strip(), "duration": lengths[vid],
                        "windows": [w]})
    err.done()
    return out


def read_activitynet_captions(json_path: str, on_error: str = "raise") -> list[dict]:
    with open(json_path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{json_path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise DatasetError(f"{json_path}:1: expected an object {{video_id: {{duration, timestamps, sentences}}}}")
    err, out = _Errors(json_path, on_error), []
    for vid, rec in data.items():
        where = f"video {vid!r}"
        if not isinstance(rec, dict) or not {"duration", "timestamps", "sentences"} <= set(rec):
            err(where, "needs 'duration', 'timestamps' and 'sentences'")
            continue
        try:
            duration = float(rec["duration"])
        except (TypeError, ValueError):
            err(where, f"duration {rec['duration']!r} is not a number")
            continue
        if len(rec["timestamps"]) != len(rec["sentences"]):
            err(where, f"{len(rec['timestamps'])} timestamps but {len(rec['sentences'])} sentences")
            continue
        for k, (ts, sent) in enumerate(zip(rec["timestamps"], rec["sentences"])):
            w = _window(*ts, duration) if isinstance(ts, (list, tuple)) and len(ts) == 2 else None
            if w is None or not isinstance(sent, str) or not sent.strip():
                err(f"{where} entry {k}", f"bad timestamp {ts!r} or empty sentence")
                continue
            out.append({"qid": f"{vid}#{k}", "vid": vid, "query": sent.strip(), "duration": duration,
                        "windows": [w]})
    err.done()
    return out


def read_qvhighlights(jsonl_path: str, on_error: str = "raise") -> list[dict]:
    err, out = _Errors(jsonl_path, on_error), []
    with open(jsonl_path, encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                err(i, f"not valid JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(rec, dict) or not {"qid", "query", "duration", "vid"} <= set(rec):
                err(i, "needs 'qid', 'query', 'duration' and 'vid'")
                continue
            try:
                duration = float(rec["duration"])
            except (TypeError, ValueError):
                err(i, f"duration {rec['duration']!r} is not a number")
                continue
            windows = None
            if "relevant_windows" in rec:
                windows = [_window(*w, duration) if isinstance(w, (list, tuple)) and len(w) == 2 else None
                           for w in rec["relevant_windows"]]
                if not windows or any(w is None for w in windows):
                    err(i, f"bad relevant_windows {rec['relevant_windows']!r}")
                    continue
            out.append({"qid": str(rec["qid"]), "vid": rec["vid"], "query": rec["query"], "duration": duration,
                        "windows": windows})
    err.done()
    return out


def find_video(video_dir: str, vid: str) -> str | None:
    """The file of video `vid` in video_dir (any common extension; ActivityNet's 'v_' prefix optional)."""
    for name in (vid, vid[2:] if vid.startswith("v_") else "v_" + vid):
        for ext in VIDEO_EXTENSIONS:
            path = os.path.join(video_dir, name + ext)
            if os.path.isfile(path):
                return path
    return None


FORMATS = {"charades_sta": read_charades_sta, "activitynet": read_activitynet_captions,
           "qvhighlights": read_qvhighlights}


def load_dataset(fmt: str, annotations: str, video_dir: str, durations: str | None = None,
                 on_error: str = "raise", missing_video: str = "raise") -> list[dict]:
    """Read `annotations` in format `fmt` and attach each example's video path ("video").

    missing_video: "raise" (the error lists the first missing files) | "skip" (counted and logged).
    """
    if fmt not in FORMATS:
        raise ConfigError(f"unknown grounding format {fmt!r}; valid: {sorted(FORMATS)}")
    if fmt == "charades_sta":
        if not durations:
            raise ConfigError("Charades-STA needs the durations csv (Charades_v1_train.csv / Charades_v1_test.csv)")
        examples = read_charades_sta(annotations, durations, on_error)
    else:
        examples = FORMATS[fmt](annotations, on_error)
    found, missing = [], []
    for ex in examples:
        path = find_video(video_dir, ex["vid"])
        (missing if path is None else found).append({**ex, "video": path})
    if missing and missing_video == "raise":
        names = ", ".join(sorted({m["vid"] for m in missing})[:5])
        raise MissingFile(f"{len(missing)} of {len(examples)} queries have no video file in {video_dir!r} "
                          f"(e.g. {names}); add the videos or set missing_video=skip")
    if missing:
        log.warning("%d of %d queries skipped: no video file in %s", len(missing), len(examples), video_dir)
        SKIPPED[f"{annotations}:missing_video"] = len(missing)
    return found
