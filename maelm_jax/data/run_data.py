"""A pretraining run's data, from its config's corpus sources: the sources checked, the
tokenizer (trained or read), the fingerprints and weights of the sources, and the blocks
packed in the job (`build_blocks`: a cache in the workdir) or the tokenizer of block
shards written by mode "prepare" (`shards_tokenizer`); the record of the data a run trains
on, which its resumption must find again (`check_resumed_data`)."""

from __future__ import annotations

import itertools
import json

import ml_collections
from absl import logging

from maelm_jax.data import packing, shards, sources
from maelm_jax.infra import paths
from maelm_jax.text import tokenizer as tokenizer_lib
from maelm_jax.workdirs import layout


def source_field(name: str) -> str:
    return f"config.data.sources.{name}"


def validate_sources(config: ml_collections.ConfigDict) -> None:
    """Fails fast (before any tokenizer training) on a source that cannot be read."""
    for name, source in config.data.sources.items():
        sources.validate_source(source, source_field(name))
    # A source that reads but yields nothing (every value null, a filter no row matches,
    # text that is all whitespace) is named here, not by the tokenizer or the packing.
    for name, source in config.data.sources.items():
        sources.first_document(source, source_field(name), config.data.encoding_errors)


def _documents(config: ml_collections.ConfigDict, name: str, stats: sources.ReadStats):
    return sources.iter_documents(
        config.data.sources[name], encoding_errors=config.data.encoding_errors, stats=stats,
        required=source_field(name))


def setup_tokenizer(
    config: ml_collections.ConfigDict, workdir: paths.Path
) -> tokenizer_lib.Tokenizer:
    """The configured file (a SentencePiece model or a Hugging Face tokenizer.json), else
    the workdir's, else a SentencePiece model trained on the sources."""
    tok_cfg = config.tokenizer
    if tok_cfg.model_path:
        return tokenizer_lib.load_tokenizer(tok_cfg.model_path, "config.tokenizer.model_path")
    path = workdir / layout.TOKENIZER_FILE
    if path.exists():
        tok = tokenizer_lib.load_tokenizer(str(path))
        if tok.vocab_size != tok_cfg.vocab_size:
            raise tokenizer_lib.TokenizerError(
                f"{path} has vocab_size {tok.vocab_size} but config.tokenizer.vocab_size is "
                f"{tok_cfg.vocab_size}; use another workdir or set it to {tok.vocab_size}"
            )
        logging.info("reusing tokenizer %s", path)
        return tok
    logging.info(
        "training a %d-piece %s tokenizer on the corpus (lowercase=%s)",
        tok_cfg.vocab_size,
        tok_cfg.model_type,
        tok_cfg.lowercase,
    )
    stats = sources.ReadStats()
    # Sources in turn, each bounded, so the largest one cannot crowd out the rest entirely.
    per_source = max(tok_cfg.max_sentences // len(config.data.sources), 1)
    documents = itertools.chain.from_iterable(
        itertools.islice(_documents(config, name, stats), per_source)
        for name in sorted(config.data.sources)
    )
    return tokenizer_lib.train_tokenizer(
        documents,
        str(path),
        tok_cfg.vocab_size,
        model_type=tok_cfg.model_type,
        lowercase=tok_cfg.lowercase,
        max_sentences=tok_cfg.max_sentences,
        seed=config.seed,
    )


def shards_tokenizer(config: ml_collections.ConfigDict,
                       workdir: paths.Path) -> tokenizer_lib.Tokenizer:
    """The tokenizer of config.data.prepared, copied into the workdir (where fine-tuning
    and fill-mask look for it). tokenizer.model_path, if set, must be the same file."""
    prepared = paths.Path(config.data.prepared)
    source = layout.tokenizer_file(prepared)
    if source is None:
        raise shards.PreparedDataError(f"config.data.prepared: {config.data.prepared} has no "
                                       f"{layout.TOKENIZER_FILE} or {layout.HF_TOKENIZER_FILE}; "
                                       "prepare it with --config.mode=prepare")
    own = config.tokenizer.model_path
    if own and paths.Path(own).read_bytes() != source.read_bytes():
        raise tokenizer_lib.TokenizerError(
            f"config.tokenizer.model_path: {own} is not the tokenizer {config.data.prepared} "
            "was prepared with; leave it empty to use that one")
    path = workdir / source.name
    if not path.exists():
        paths.write_atomically(path, source.read_bytes())
    tok = tokenizer_lib.load_tokenizer(str(path))
    if tok.vocab_size != config.tokenizer.vocab_size:
        raise tokenizer_lib.TokenizerError(
            f"config.tokenizer.vocab_size: {config.data.prepared} was prepared with a "
            f"{tok.vocab_size}-piece tokenizer, the config says {config.tokenizer.vocab_size}")
    return tok


def source_fingerprints(config: ml_collections.ConfigDict) -> dict[str, str]:
    """Each source's `sources.source_fingerprint`: what its prepared blocks are keyed by."""
    return {name: sources.source_fingerprint(source)
            for name, source in config.data.sources.items()}


def data_fingerprint(config: ml_collections.ConfigDict, tok: tokenizer_lib.Tokenizer) -> str:
    """What the config's blocks are keyed by (packing.data_fingerprint): the sources'
    content, the tokenizer's bytes, seq_len and the validation fraction; for data.prepared,
    the fingerprint its manifest records."""
    if config.data.prepared:
        return shards.read_manifest(paths.Path(config.data.prepared))["fingerprint"]
    return packing.data_fingerprint(source_fingerprints(config), tok.model_path,
                                    config.data.seq_len, config.data.validation_fraction)


def source_weights(config: ml_collections.ConfigDict) -> dict[str, float]:
    return {name: float(sources.source_settings(source)["weight"])
            for name, source in config.data.sources.items()}


def build_blocks(
    config: ml_collections.ConfigDict, workdir: paths.Path, tok: tokenizer_lib.Tokenizer
) -> shards.PreparedData:
    """Packs every source into blocks of data.seq_len, or reuses an identical earlier run."""
    cache_dir = paths.Path(config.data.cache_dir or workdir / layout.DATA_DIR)
    stats = {name: sources.ReadStats() for name in config.data.sources}
    inputs = {name: _documents(config, name, stats[name]) for name in config.data.sources}
    data = packing.pack_blocks(inputs, source_fingerprints(config), tok, config.data.seq_len,
                           config.data.validation_fraction, cache_dir,
                           weights=source_weights(config), read=stats,
                           blocks_per_shard=config.prepare.blocks_per_shard,
                           cache_bytes=int(config.data.prepared_cache_gb * 2**30))
    for name, read in stats.items():
        if read.bounded_summary():
            logging.warning("%s: %s (a minified or badly converted file?)", source_field(name),
                            read.bounded_summary())
    replaced = sum(read.replaced for read in stats.values())
    if replaced:
        logging.warning(
            "replaced %d invalid UTF-8 sequences while reading the corpus "
            "(config.data.encoding_errors='strict' makes this an error)",
            replaced,
        )
    return data


def data_record(data: shards.PreparedData) -> dict:
    """What a run records of the data it trains on (<workdir>/data.json): the set's
    fingerprint (sources' content, tokenizer, seq_len, validation fraction) and, to say
    what changed, each source's documents and tokens per split."""
    manifest = shards.read_manifest(data.directory)
    return {"fingerprint": manifest["fingerprint"],
            "sources": {name: {split: {k: entry[split].get(k) for k in ("documents", "tokens")}
                               for split in shards.SPLITS}
                        for name, entry in sorted(manifest["sources"].items())}}


def data_changes(recorded: dict, now: dict) -> str:
    """The difference between two `data_record`s in words."""
    was, is_ = recorded.get("sources") or {}, now["sources"]
    said = [f"source {name} {'added' if name not in was else 'removed'}"
            for name in sorted(set(was) ^ set(is_))]
    for name in sorted(set(was) & set(is_)):
        if was[name] != is_[name]:
            old, new = was[name].get("train") or {}, is_[name]["train"]
            said.append(f"source {name}: {old.get('documents')} training documents then, "
                        f"{new['documents']} now")
    said = said or ["the sources hold as many documents, with other content or tokenizer"]
    return (f"{'; '.join(said)} (fingerprint {recorded.get('fingerprint')} then, "
            f"{now['fingerprint']} now)")


def check_resumed_data(workdir: paths.Path, record: dict, resumed: bool,
                       allow_config_change: bool) -> None:
    """Refuses (one line) to continue a run's checkpoints on data other than the data it
    recorded: the same source path with more documents would otherwise give another block
    stream and another evaluation set, silently. With `allow_config_change` it says what
    changed and goes on."""
    path = workdir / layout.DATA_RECORD_FILE
    if not resumed or not path.is_file():
        return
    try:
        recorded = json.loads(paths.read_text(path))
        fingerprint = recorded["fingerprint"]
    except (ValueError, KeyError, TypeError):
        raise layout.WorkdirError(
            f"{path} is not a data record this version reads; it records the data this "
            "run trained on: repair it, or use another --workdir") from None
    if fingerprint == record["fingerprint"]:
        return
    changed = data_changes(recorded, record)
    if not allow_config_change:
        raise layout.WorkdirError(
            f"{workdir} holds a run trained on other data ({changed}); its checkpoints "
            "would continue on other blocks and another evaluation set: give it its data "
            "again, use another --workdir, or pass --allow_config_change to continue on "
            "this data anyway")
    logging.warning("continuing %s on other data than it trained on, as "
                    "--allow_config_change asks: %s", workdir, changed)
