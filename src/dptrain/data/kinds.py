"""The kinds of data source in one table: how each recognises its `--data`, checks it without loading
it (`dptrain launch`), loads it, and records it in a run's config.yaml.

In order of precedence (the first kind that recognises the settings is the one):

- ``factory``: ``package.module:factory`` or ``path/to/FILE.py:factory`` (not a path on disk), the
  user's function returning torch Datasets (dptrain.data.user)
- ``shard pattern``: WebDataset .tar shards by pattern, or a directory of .parquet files
  (dptrain.data.shard_files: read as a stream, dptrain.data.streams)
- ``image folder``: a directory of class subfolders holding images (dptrain.data.images)
- ``array file``: any other ``--data``: an .npz, .h5/.hdf5 or .zarr file, or a directory holding
  x.npy and y.npy (dptrain.data.sources)
- ``built-in``: no ``--data``; ``--dataset`` names a built-in data set (dptrain.data.sources, registry.py)

A new kind is a `Source` and one `register_source` call (by default it goes before the array files,
which take any path). Every kind loads into one `DataSplits`. This module imports neither numpy
nor torch, so that the config and `dptrain launch` use it cheaply; loading imports the kind's module.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional, Protocol

from dptrain import registry
from dptrain.data.image_files import is_image_folder
from dptrain.data.splits import DataSplits
from dptrain.errors import UserError
from dptrain.user_code import FILE_SPEC, check_spec_file, looks_like_spec


class DataSettings(Protocol):
    """The settings a source may read (dptrain.config.TrainConfig has them all)."""

    data: Optional[str]
    dataset: Optional[str]
    seed: int
    task: str
    samples: Optional[int]
    image_size: Optional[int]
    augment: bool
    channels: int
    classes: int
    features: int
    block_size: Optional[int]


class Source:
    """One kind of data source. `data` is --data as given (None: the built-in --dataset); `base` is the
    directory a relative --data is taken from."""

    kind: str = ""  # its name, for register_source's `before`
    help: str = ""  # what a --data of this kind is, in --help ("" for a kind --data does not name)
    options: tuple[str, ...] = ()  # the settings besides --data it reads; the others are refused with it (config)

    def recognises(self, data: Optional[str], base: Path) -> bool:
        """Whether `data` is of this kind, from its form and at most a look at names on disk."""
        raise NotImplementedError

    def reads(self, settings: DataSettings) -> tuple[str, ...]:
        """The settings (DataSettings fields besides data) that loading `settings`' data reads."""
        return self.options

    def may_read(self) -> tuple[str, ...]:
        """Every setting this kind reads for some data."""
        return self.options

    def described(self, settings: Optional[DataSettings] = None) -> str:
        """This kind in words ('an image folder'), or `settings`' data of this kind ("--data 'x' (an image folder)")."""
        kind = f"{'an' if self.kind[:1] in 'aeiou' else 'a'} {self.kind}"
        return kind if settings is None else f"--data '{settings.data}' ({kind})"

    def read_by(self, option: str) -> list[str]:
        """Who of this kind reads `option`, in words, for a kind that --data does not name (empty: nobody)."""
        return []

    def check(self, data: Optional[str], base: Path) -> None:
        """One UserError line when `data` cannot be loaded, found without reading it (dptrain launch,
        before it writes a job script). By default there is nothing to check."""

    def load(self, settings: DataSettings, check_values: bool, log: Callable[[str], None]) -> DataSplits:
        """The data, checked; `check_values`: also scan every value (the validating process does, workers
        need not); `log` says what was decided (a held-out split, the task)."""
        raise NotImplementedError

    def absolute(self, data: str, base: str) -> str:
        """`data` as a run's config.yaml records it, to repeat the run from any directory: a path on disk
        made absolute from `base`, anything else as it is."""
        path = os.path.join(base, data)
        return os.path.abspath(path) if os.path.exists(path) else data


def _no_augment(settings: DataSettings) -> None:
    if settings.augment:
        raise UserError("--augment applies to a folder of images given as --data")


class Factory(Source):
    kind = "factory"
    help = "package.module:factory returning (train, test) torch Datasets, or one Dataset (20 % held out for testing)"
    options = ("task",)

    def recognises(self, data: Optional[str], base: Path) -> bool:
        return data is not None and looks_like_spec(data) and not (base / data).exists()

    def check(self, data: Optional[str], base: Path) -> None:
        check_spec_file(data, "--data")  # a FILE.py:factory's file must be there; modules are imported by the run

    def load(self, settings: DataSettings, check_values: bool, log: Callable[[str], None]) -> DataSplits:
        from dptrain.data.user import load_user_data
        return load_user_data(settings.data, settings.seed, log=log, task=settings.task, check_values=check_values,
                              workers=getattr(settings, "workers", 1))

    def absolute(self, data: str, base: str) -> str:
        match = FILE_SPEC.match(data)
        return f"{os.path.abspath(os.path.join(base, match['path']))}:{match['attribute']}" if match else data


class ShardFiles(Source):
    kind = "shard pattern"
    help = ("shards: a pattern of WebDataset .tar files ('shards/train-{000000..000099}.tar') or a directory "
            "of .parquet files (dptrain.data.shard_files)")
    options = ("task", "stage_to")

    def recognises(self, data: Optional[str], base: Path) -> bool:
        from dptrain.data.shard_patterns import looks_like_shards
        return looks_like_shards(data, base)

    def check(self, data: Optional[str], base: Path) -> None:
        from dptrain.data.shard_patterns import shard_paths
        shard_paths(data, base)

    def load(self, settings: DataSettings, check_values: bool, log: Callable[[str], None]) -> DataSplits:
        from dptrain.data.shard_files import open_shards
        from dptrain.data.stream_splits import stream_splits
        _no_augment(settings)
        stream = open_shards(settings.data, stage_to=getattr(settings, "stage_to", None),
                             timeout=getattr(settings, "timeout", 300.0))
        return stream_splits(stream, None, settings.data, log, settings.task)

    def absolute(self, data: str, base: str) -> str:
        return data if os.path.isabs(data) else os.path.join(os.path.abspath(base), data)


class ImageFolderSource(Source):
    kind = "image folder"
    help = "a folder of images, one subfolder per class"
    options = ("task", "image_size", "augment")

    def recognises(self, data: Optional[str], base: Path) -> bool:
        return data is not None and is_image_folder(str(base / data))

    def load(self, settings: DataSettings, check_values: bool, log: Callable[[str], None]) -> DataSplits:
        from dptrain.data.images import load_image_folder
        return load_image_folder(settings.data, settings.seed, settings.image_size, settings.augment, log,
                                 settings.task)


class ArrayFile(Source):
    kind = "array file"
    help = "a file (.npz, .npy, .h5, .zarr) with x, y and optional x_test, y_test"
    options = ("task", "block_size")

    def recognises(self, data: Optional[str], base: Path) -> bool:
        return data is not None

    def check(self, data: Optional[str], base: Path) -> None:
        if not (base / data).exists():
            raise UserError(f"--data '{data}' does not exist (in {base}); give a data file or folder, "
                            "or package.module:factory")

    def load(self, settings: DataSettings, check_values: bool, log: Callable[[str], None]) -> DataSplits:
        _no_augment(settings)
        return _arrays(None, settings, check_values, log)


class BuiltIn(Source):
    kind = "built-in"
    options = ("dataset", "block_size")
    # What each built-in data set reads besides those; one registered elsewhere may read any of BUILT_IN_SETTINGS.
    DATASET_OPTIONS = {"digits": (), "mnist1d": (), "synthetic-images": ("samples", "image_size", "channels", "classes"),
                       "synthetic-regression": ("samples", "features")}
    BUILT_IN_SETTINGS = ("samples", "image_size", "channels", "classes", "features")

    def reads(self, settings: DataSettings) -> tuple[str, ...]:
        return self.options + self.DATASET_OPTIONS.get(settings.dataset, self.BUILT_IN_SETTINGS)

    def may_read(self) -> tuple[str, ...]:
        return self.options + self.BUILT_IN_SETTINGS

    def described(self, settings: Optional[DataSettings] = None) -> str:
        return "built-in data (no --data)" if settings is None else f"--dataset {settings.dataset}"

    def read_by(self, option: str) -> list[str]:
        if option in self.options:
            return [self.described()]
        names = [name for name in registry.names("dataset")
                 if option in self.DATASET_OPTIONS.get(name, self.BUILT_IN_SETTINGS)]
        return [f"--dataset {' or '.join(names)}"] if names else []

    def recognises(self, data: Optional[str], base: Path) -> bool:
        return data is None

    def load(self, settings: DataSettings, check_values: bool, log: Callable[[str], None]) -> DataSplits:
        _no_augment(settings)
        if settings.task != "auto":
            raise UserError(f"--task {settings.task} applies to your own --data; the built-in {settings.dataset} "
                            "knows its task")
        return _arrays(settings.dataset, settings, check_values, log)


def _arrays(name: Optional[str], settings: DataSettings, check_values: bool,
            log: Callable[[str], None]) -> DataSplits:
    from dptrain.data.sources import load_dataset
    return load_dataset(name, data_path=settings.data, seed=settings.seed, block_size=settings.block_size,
                        samples=settings.samples, image_size=settings.image_size, channels=settings.channels,
                        classes=settings.classes, features=settings.features, check_values=check_values,
                        task=settings.task, log=log).splits()


# The table, in order of precedence: the first kind that recognises --data is the one.
SOURCES: list[Source] = [Factory(), ShardFiles(), ImageFolderSource(), ArrayFile(), BuiltIn()]


def register_source(source: Source, before: str = ArrayFile.kind) -> None:
    """Add a kind of data source to the table, ahead of the kind named `before` (by default the array
    files, which take any path). In this process only: `dptrain train`'s spawned workers load the table
    of their own, so a kind they need is a line in SOURCES."""
    kinds = [entry.kind for entry in SOURCES]
    if source.kind in kinds:
        raise ValueError(f"a data source of kind '{source.kind}' is registered already")
    if before not in kinds:
        raise ValueError(f"no data source of kind '{before}' to register before; kinds: {', '.join(kinds)}")
    SOURCES.insert(kinds.index(before), source)


def find_source(data: Optional[str], base: Path = Path()) -> Source:
    """The kind of `data` (--data as given, None for a built-in --dataset), relative paths from `base`."""
    return next(source for source in SOURCES if source.recognises(data, base))


def load_data(settings: DataSettings, check_values: bool = True, log: Callable[[str], None] = print) -> DataSplits:
    """The data the settings name (their --data, or their built-in --dataset), loaded by its kind."""
    return find_source(settings.data).load(settings, check_values, log)


def check_spec(data: Optional[str], base: Path) -> None:
    """One UserError line when --data `data` (relative to `base`) cannot be loaded, found without loading it."""
    find_source(data, base).check(data, base)


def absolute_spec(data: str, base: str) -> str:
    """--data as a run's config.yaml records it: what lies on disk as an absolute path (see Source.absolute)."""
    return find_source(data, Path(base)).absolute(data, base)


def data_options() -> list[str]:
    """The settings that some kind of data reads and others do not (dptrain.config refuses them where they
    do not apply), in the order of the table."""
    return list(dict.fromkeys(option for source in SOURCES for option in source.may_read()))


def readers_of(option: str) -> str:
    """The kinds (and built-in data sets) that read `option`, in words."""
    named = [source for source in SOURCES if source.help]  # the kinds --data names
    reading = [source for source in named if option in source.may_read()]
    words = [] if not reading else ["your own --data"] if reading == named else [
        "--data as " + " or ".join(source.described() for source in reading)]
    return " and ".join(words + [who for source in SOURCES if not source.help for who in source.read_by(option)])


def data_help() -> str:
    """The --data help: what each kind of --data is, in order of precedence."""
    forms = [source.help for source in SOURCES if source.help]
    listed = f"{'; '.join(forms[:-1])}; or {forms[-1]}" if len(forms) > 1 else forms[0]
    return f"user data: {listed}; replaces --dataset"
