"""Corpora as columns: Parquet files and Hugging Face datasets saved to disk, read with
pyarrow one row group (or record batch) at a time.

The text sets on the Hugging Face Hub (Wikipedia, C4, FineWeb, ...) are Parquet shards, and
`datasets.save_to_disk` writes Arrow IPC stream files beside a ``state.json`` naming them;
both are read here without the `datasets` package, local or in a bucket:

``parquet``  ``path``: a file, a directory (its ``*.parquet`` files, recursively), a glob or
             several; ``text_field`` (``"text"``): the column of documents, one per row;
             ``filter_field`` and ``filter_value``: keep only the rows whose column
             ``filter_field`` equals ``filter_value`` (e.g. a language), none by default.
``hf_disk``  ``path``: a `save_to_disk` directory (a Dataset, or a DatasetDict whose
             ``split``, default ``"train"``, is read), or ``.arrow`` files (Arrow's IPC
             stream format, which save_to_disk writes, or its file format, Feather v2);
             the same ``text_field``, ``filter_field`` and ``filter_value``.

Memory is bounded by a row group (a record batch), never a file. A null value is no
document (skipped and counted); a row group's text is decoded by Arrow, so invalid UTF-8
cannot occur. A missing or non-string column, a file without rows anywhere, or a file
Arrow cannot read is one SourceError naming the file and the field. Files are in the
path's order, rows in file order, so the documents' order, and so the prepared blocks, are
the same in the job and in Beam's per-file work items.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from maelm_jax.data.files import SourceError, resolve_paths
from maelm_jax.infra import paths

KINDS = ("parquet", "hf_disk")
# A DatasetDict's list of splits; a Dataset's list of its Arrow files.
_DATASET_DICT, _STATE = "dataset_dict.json", "state.json"


def _join(directory: str, name: str) -> str:
    return f"{directory.rstrip('/')}/{name}"


def _arrow_files(directory: str, split: str, field_name: str) -> list[str]:
    """The Arrow files of a save_to_disk directory, in the order state.json lists them."""
    if paths.Path(_join(directory, _DATASET_DICT)).is_file():
        splits = json.loads(paths.read_text(paths.Path(_join(directory, _DATASET_DICT))))
        splits = splits.get("splits", []) if isinstance(splits, dict) else []
        if split not in splits:
            raise SourceError(f"{field_name}.split: {directory} has no split {split!r}; "
                              f"available: {', '.join(map(str, splits)) or 'none'}")
        directory = _join(directory, split)
    state = paths.Path(_join(directory, _STATE))
    if not state.is_file():
        raise SourceError(f"{field_name}.path: {directory} is not a directory written by "
                          f"datasets' save_to_disk (no {_STATE} or {_DATASET_DICT})")
    try:
        listed = json.loads(paths.read_text(state))["_data_files"]
        return [_join(directory, entry["filename"]) for entry in listed]
    except (ValueError, KeyError, TypeError) as e:
        raise SourceError(f"{field_name}.path: {state} does not list the dataset's files "
                          f"({type(e).__name__}: {e})") from None


def files(settings: dict[str, Any], field_name: str = "source") -> list[str]:
    """The files a columnar source reads, in order."""
    where = f"{field_name}.path"
    if settings["kind"] == "parquet":
        found = resolve_paths(settings["path"], where)
        # A directory's other files (_SUCCESS, checksums, a README) are not data.
        named = [f for f in found if f.endswith(".parquet")]
        return named if named else found
    out: dict[str, None] = {}
    specs = settings["path"].split(",") if isinstance(settings["path"], str) else \
        list(settings["path"])
    for spec in (str(s).strip() for s in specs if str(s).strip()):
        if paths.Path(spec).is_dir():
            out.update(dict.fromkeys(_arrow_files(spec, settings["split"], field_name)))
        else:
            out.update(dict.fromkeys(resolve_paths(spec, where)))
    if not out:
        raise SourceError(f"{where}: expected a save_to_disk directory or its .arrow files, "
                          f"got {settings['path']!r}")
    return list(out)


# The first bytes of Arrow's IPC file format (Feather v2, what pyarrow.feather and
# ipc.new_file write); datasets' save_to_disk writes the stream format, which has none.
_ARROW_FILE_MAGIC = b"ARROW1"


def _arrow_batches(f) -> tuple[Any, Iterator[Any]]:
    """(schema, record batches) of an Arrow file in either IPC format: the stream format
    (datasets' save_to_disk) or the file format (Feather v2)."""
    import pyarrow as pa

    if f.read(len(_ARROW_FILE_MAGIC)) == _ARROW_FILE_MAGIC:
        f.seek(0)
        reader = pa.ipc.open_file(f)
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
    f.seek(0)
    reader = pa.ipc.open_stream(f)
    return reader.schema, iter(reader)


def _batches(path: str, columns: list[str]) -> Iterator[Any]:
    """The file's record batches (a Parquet file's row groups), with `columns` only."""
    import pyarrow.parquet as pq

    with paths.Path(path).open("rb") as f:
        if path.endswith(".arrow"):
            for batch in _arrow_batches(f)[1]:
                yield batch.select(columns)
            return
        parquet = pq.ParquetFile(f)
        for group in range(parquet.num_row_groups):
            yield parquet.read_row_group(group, columns=columns)


def _schema(path: str, count_rows: bool):
    """(the file's Arrow schema, whether it has rows: from a Parquet footer; a stream,
    which has no footer, is read until its first non-empty batch, only if `count_rows`)."""
    import pyarrow.parquet as pq

    with paths.Path(path).open("rb") as f:
        if path.endswith(".arrow"):
            schema, batches = _arrow_batches(f)
            rows = count_rows and any(batch.num_rows for batch in batches)
            return schema, rows
        meta = pq.ParquetFile(f)
        return meta.schema_arrow, meta.metadata.num_rows > 0


def _arrow_error(path: str, error: Exception, field_name: str) -> SourceError:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return SourceError(f"{field_name}.path: {path} cannot be read as "
                       f"{'Arrow (IPC stream or file)' if path.endswith('.arrow') else 'Parquet'} "
                       f"({reason})")


def check(settings: dict[str, Any], field_name: str) -> None:
    """Every file is readable and has the source's columns, its text column a string; the
    source has rows. Reads footers (a stream's batches), not the text."""
    import pyarrow as pa

    any_rows = False
    for path in files(settings, field_name):
        try:
            schema, rows = _schema(path, count_rows=not any_rows)
        except (OSError, pa.ArrowException) as e:
            raise _arrow_error(path, e, field_name) from None
        any_rows = any_rows or rows
        for name in (settings["text_field"], settings["filter_field"]):
            if name and name not in schema.names:
                field = "text_field" if name == settings["text_field"] else "filter_field"
                raise SourceError(f"{field_name}.{field}: {path} has no column {name!r}; "
                                  f"columns: {', '.join(schema.names)}")
        kind = schema.field(settings["text_field"]).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or pa.types.is_string_view(kind)):
            raise SourceError(f"{field_name}.text_field: column {settings['text_field']!r} of "
                              f"{path} is {kind}, expected strings")
    if not any_rows:
        raise SourceError(f"{field_name}.path: {settings['path']!r} holds no rows")


def documents(settings: dict[str, Any], stats) -> Iterator[str]:
    """Each row's text, in file and row order (rows of another filter value, and nulls,
    skipped); `stats.files` counts the files."""
    import pyarrow as pa

    text, keep = settings["text_field"], settings["filter_field"]
    columns = [text] + ([keep] if keep and keep != text else [])
    for path in files(settings):
        stats.files += 1
        try:
            for batch in _batches(path, columns):
                values = batch.column(text).to_pylist()
                if keep:
                    wanted = settings["filter_value"]
                    chosen = batch.column(keep).to_pylist()
                    kept = [v for v, c in zip(values, chosen, strict=True) if c == wanted]
                    stats.filtered += len(values) - len(kept)
                    values = kept
                for value in values:
                    if value is None:
                        stats.nulls += 1
                    elif not isinstance(value, str):
                        raise SourceError(f"source.text_field: column {text!r} of {path} "
                                          f"holds {type(value).__name__}, expected strings")
                    else:
                        yield value
        except (OSError, pa.ArrowException, KeyError) as e:
            raise _arrow_error(path, e, "source") from None
