"""Where training data comes from: built-in datasets by name, or the user's own file, checked and split.

Built-in datasets (``DATASET_NAMES``):

- ``digits``: scikit-learn's bundled 8x8 handwritten digits (no download), x float32
  ``(n, 1, 8, 8)`` in [0, 1], 10 classes. The train/test split is fixed (stratified,
  ``random_state=0``, 1437 train / 360 test) whatever ``seed`` is, so every run is
  evaluated on the same test set.
- ``mnist1d``: MNIST-1D (Greydanus 2020, "Scaling down deep learning"), generated offline by the
  ``mnist1d`` package (``pip install mnist1d``) with its default arguments
  (``make_dataset(get_dataset_args())``, seed 42; its download path is never used): x float32
  ``(n, 1, 40)`` (one channel, 40 steps), 10 classes, the package's own split (4000 train /
  1000 test) whatever ``seed`` is.
- ``synthetic-images``: class-conditional images generated from ``seed``, float32
  ``(n, channels, image_size, image_size)``. Each class has a smooth random template (a sum
  of low-frequency waves); a sample is its class template, circularly shifted and scaled at
  random, plus pixel noise. Learnable by a small CNN, but not within a few steps.
- ``synthetic-regression``: ``features`` standard-normal inputs; the target, shape ``(n, 1)``,
  is a sigmoid of a random nonlinear function of the inputs plus a little noise, so it lies
  in (0, 1) and suits an MLP with a sigmoid output.

User data (``data_path``; ``name`` is then only a label and must not be a built-in name):

- ``.npz``, ``.h5``/``.hdf5`` or ``.zarr`` (directory or zip): arrays named ``x`` and ``y``,
  optionally ``x_test`` and ``y_test``.
- a directory (not ``.zarr``) holding ``x.npy`` and ``y.npy``, optionally ``x_test.npy`` and
  ``y_test.npy``; each is memory-mapped.

Arrays are opened lazily with :meth:`DSTensor.from_file` (an ``.npz`` member is loaded whole by
numpy). Without ``x_test``/``y_test`` the test set is split off deterministically: with
``perm = np.random.default_rng(seed).permutation(n)``, samples ``perm[:n_test]`` form the
test set and the rest the training set, each kept in file order, where
``n_test = round(test_fraction * n)`` (dptrain.data.holdout; ``test_fraction`` defaults to its
``HOLD_OUT``, 0.2). Integer ``y`` means classification with
``num_classes = max(label) + 1``; floating ``y`` means regression.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable
from pathlib import Path

import numpy as np

from dptrain import registry
from dptrain.data.dstensor import DSTensor, list_arrays
from dptrain.data.holdout import HOLD_OUT, hold_out, holding_out_line
from dptrain.data.image_files import IMAGE_SUFFIXES, class_dirs
from dptrain.data.labels import negative_label, say_missing_classes, unseen_label
from dptrain.errors import UserError, unknown_name

DATASET_NAMES = registry.names("dataset")
ARRAY_NAMES = ("x", "y", "x_test", "y_test")


@dataclass(frozen=True)
class Dataset:
    """Train and test splits of one dataset, with what a model needs to know about it."""

    x_train: DSTensor
    y_train: DSTensor
    x_test: DSTensor
    y_test: DSTensor
    task: str  # "classification" | "regression"
    num_classes: int | None  # None for regression
    input_shape: tuple[int, ...]  # per-sample shape of x
    name: str

    def train_set(self):
        """The training split as a torch Dataset (imported here: loading data needs no torch)."""
        from dptrain.data.sampler import ArrayPairs
        return ArrayPairs(self.x_train, self.y_train)

    def test_set(self):
        from dptrain.data.sampler import ArrayPairs
        return ArrayPairs(self.x_test, self.y_test)

    @property
    def num_outputs(self) -> int:
        """Model outputs: one per class, or the target's width for regression (1 for 1-D targets)."""
        if self.num_classes is not None:
            return self.num_classes
        return int(np.prod(self.y_train.shape[1:], dtype=np.int64))

    def splits(self):
        """The DataSplits of these arrays (dptrain.data.kinds): what every kind of source loads into."""
        from dptrain.data.splits import DataSplits
        return DataSplits(self.train_set(), self.test_set(), self.task, self.num_classes, self.input_shape,
                          self.num_outputs, self.name)


def load_dataset(
    name: str | None,
    *,
    data_path: str | None = None,
    seed: int = 0,
    block_size: int | None = None,
    samples: int | None = None,
    image_size: int | None = None,
    channels: int = 3,
    classes: int = 10,
    features: int = 8,
    test_fraction: float = HOLD_OUT,
    check_values: bool = True,
    task: str = "auto",
    log: Callable[[str], None] | None = None,
) -> Dataset:
    """A built-in dataset by ``name``, or the user's data at ``data_path`` (see the module docstring)."""
    if not 0.0 < test_fraction < 1.0:
        raise UserError(f"test_fraction {test_fraction!r} is invalid; use a number strictly between 0 and 1.")
    if data_path is not None:
        if name in registry.names("dataset"):  # read now: an entry registered after import counts too
            raise UserError(
                f"--dataset {name} is built in, so --data '{data_path}' cannot also be used; give one or the other."
            )
        if samples is not None:
            raise UserError(f"--samples {samples} applies only to synthetic data sets, not to --data '{data_path}'.")
        return _load_file(Path(data_path), name, seed, block_size, test_fraction, check_values, task,
                          log or (lambda message: None))
    if name is None:
        raise UserError(f"no data given; name a --dataset ({', '.join(registry.names('dataset'))}) or give --data.")
    if name not in registry.names("dataset"):
        raise unknown_name("dataset", name, registry.names("dataset"))
    settings = BuiltinSettings(seed, block_size, samples, image_size, channels, classes, features, test_fraction)
    return registry.load("dataset", name)(settings)


# ------------------------------------------------------------------------- built-in


@dataclass(frozen=True)
class BuiltinSettings:
    """What a built-in data set may be asked for; each uses the fields that apply to it."""

    seed: int
    block_size: int | None
    samples: int | None
    image_size: int | None  # synthetic-images: 32 when not given
    channels: int
    classes: int
    features: int
    test_fraction: float


def digits(settings: BuiltinSettings) -> Dataset:
    if settings.samples is not None:
        raise UserError(f"--samples {settings.samples} applies only to synthetic data sets, not to digits.")
    block_size = settings.block_size
    x, y = _digits_arrays()
    train, test = stratified_split(y, HOLD_OUT, 0)  # fixed whatever the seed: scikit-learn's split
    return Dataset(
        x_train=DSTensor.from_array(x[train], block_size),
        y_train=DSTensor.from_array(y[train], block_size),
        x_test=DSTensor.from_array(x[test], block_size),
        y_test=DSTensor.from_array(y[test], block_size),
        task="classification",
        num_classes=10,
        input_shape=(1, 8, 8),
        name="digits",
    )


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as (x, y), read from the file it ships, without importing scikit-learn.

    Importing scikit-learn (it imports SciPy) takes about a second, once in the launching process
    and once in every worker; reading the 1,797 rows takes a few milliseconds. The values are
    those of ``sklearn.datasets.load_digits()``: the same file, parsed by ``np.loadtxt`` as it
    parses it. If the file is not where scikit-learn keeps it, scikit-learn loads it.
    """
    import gzip
    from importlib.util import find_spec

    spec = find_spec("sklearn")  # finds the package without running it
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = next((Path(p) / "datasets" / "data" / "digits.csv.gz" for p in locations
                 if (Path(p) / "datasets" / "data" / "digits.csv.gz").is_file()), None)
    if path is None:
        from sklearn.datasets import load_digits
        bunch = load_digits()
        data, target = bunch.data, bunch.target
    else:
        with gzip.open(path, mode="rt", encoding="utf-8") as handle:
            table = np.loadtxt(handle, delimiter=",")
        data, target = table[:, :-1], table[:, -1].astype(int, copy=False)
    return (data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8), target.astype(np.int64)


def mnist1d(settings: BuiltinSettings) -> Dataset:
    if settings.samples is not None:
        raise UserError(f"--samples {settings.samples} applies only to synthetic data sets, not to mnist1d.")
    x, y, x_test, y_test = mnist1d_arrays()
    block_size = settings.block_size
    return Dataset(
        x_train=DSTensor.from_array(x, block_size),
        y_train=DSTensor.from_array(y, block_size),
        x_test=DSTensor.from_array(x_test, block_size),
        y_test=DSTensor.from_array(y_test, block_size),
        task="classification",
        num_classes=10,
        input_shape=x.shape[1:],
        name="mnist1d",
    )


def mnist1d_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x, y, x_test, y_test) of ``mnist1d.data.make_dataset(get_dataset_args())``: x as float32
    ``(n, 1, 40)``, labels int64. Generated (about a second), never downloaded. The package seeds
    NumPy's global generator; its state is restored afterwards so nothing else sees the change."""
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError:
        raise UserError("dataset mnist1d needs the mnist1d package; install it with: pip install mnist1d") from None
    state = np.random.get_state()
    try:
        data = make_dataset(get_dataset_args())
    finally:
        np.random.set_state(state)

    def samples(key: str) -> np.ndarray:
        return np.asarray(data[key], dtype=np.float32)[:, None, :]

    return (samples("x"), np.asarray(data["y"], dtype=np.int64), samples("x_test"),
            np.asarray(data["y_test"], dtype=np.int64))


def stratified_split(y: np.ndarray, test_size: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) indices of ``sklearn.model_selection.train_test_split(..., test_size=test_size,
    random_state=seed, stratify=y)``, in its order, computed as its StratifiedShuffleSplit does but
    without importing scikit-learn (tests/test_datasets.py checks the two agree)."""
    n = len(y)
    n_test = int(np.ceil(test_size * n))
    n_train = n - n_test
    _, y_indices, class_counts = np.unique(y, return_inverse=True, return_counts=True)
    class_indices = np.split(np.argsort(y_indices, kind="stable"), np.cumsum(class_counts)[:-1])
    rng = np.random.RandomState(seed)
    n_i = _approximate_mode(class_counts, n_train, rng)
    t_i = _approximate_mode(class_counts - n_i, n_test, rng)
    train: list[int] = []
    test: list[int] = []
    for i, count in enumerate(class_counts):
        members = class_indices[i].take(rng.permutation(count), mode="clip")
        train.extend(members[: n_i[i]])
        test.extend(members[n_i[i]: n_i[i] + t_i[i]])
    return rng.permutation(train), rng.permutation(test)


def _approximate_mode(class_counts: np.ndarray, n_draws: int, rng: np.random.RandomState) -> np.ndarray:
    """scikit-learn's ``sklearn.utils.extmath._approximate_mode``: draws per class, ties broken by ``rng``."""
    continuous = class_counts / class_counts.sum() * n_draws
    floored = np.floor(continuous)
    need_to_add = int(n_draws - floored.sum())
    if need_to_add > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (inds,) = np.where(remainder == value)
            add_now = min(len(inds), need_to_add)
            inds = rng.choice(inds, size=add_now, replace=False)
            floored[inds] += 1
            need_to_add -= add_now
            if need_to_add == 0:
                break
    return floored.astype(int)


def synthetic_images(settings: BuiltinSettings) -> Dataset:
    rng = _synthetic_rng(settings)
    x, y = _synthetic_images(rng, settings.samples or 2048, settings.classes, settings.channels,
                             settings.image_size or 32)
    return _synthetic("synthetic-images", x, y, "classification", settings.classes, settings)


def synthetic_regression(settings: BuiltinSettings) -> Dataset:
    x, y = _synthetic_regression(_synthetic_rng(settings), settings.samples or 4096, settings.features)
    return _synthetic("synthetic-regression", x, y, "regression", None, settings)


def _synthetic_rng(settings: BuiltinSettings) -> np.random.Generator:
    """The generator of a synthetic data set, after checking the sizes it is asked for."""
    for key in ("samples", "image_size", "channels", "features"):
        value = getattr(settings, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserError(f"{key} {value!r} is invalid; use a positive integer.")
    classes = settings.classes
    if isinstance(classes, bool) or not isinstance(classes, int) or classes < 2:
        raise UserError(f"classes {classes!r} is invalid; use an integer of at least 2.")
    return np.random.default_rng(settings.seed)


def _synthetic(name: str, x: np.ndarray, y: np.ndarray, task: str, num_classes: int | None,
               settings: BuiltinSettings) -> Dataset:
    x_train, y_train, x_test, y_test = _split(DSTensor.from_array(x, settings.block_size),
                                              DSTensor.from_array(y, settings.block_size),
                                              settings.test_fraction, settings.seed, name)
    return Dataset(x_train, y_train, x_test, y_test, task, num_classes, x.shape[1:], name)


def _synthetic_images(
    rng: np.random.Generator, n: int, classes: int, channels: int, size: int
) -> tuple[np.ndarray, np.ndarray]:
    waves = 3
    # Integer frequencies keep every template periodic, so a circular shift is still the same pattern.
    freq = rng.integers(-2, 3, size=(classes, channels, waves, 2))
    phase = rng.uniform(0, 2 * np.pi, size=(classes, channels, waves))
    amp = rng.uniform(0.5, 1.0, size=(classes, channels, waves))
    grid = np.arange(size) / size
    angle = (
        freq[..., 0, None, None] * grid[:, None] + freq[..., 1, None, None] * grid[None, :]
    ) * 2 * np.pi + phase[..., None, None]
    templates = (amp[..., None, None] * np.cos(angle)).sum(axis=2)
    templates /= templates.std(axis=(1, 2, 3), keepdims=True) + 1e-6

    labels = rng.integers(classes, size=n)
    max_shift = max(size // 4, 1)
    dy, dx = rng.integers(-max_shift, max_shift + 1, size=(2, n))
    rows = (np.arange(size) - dy[:, None]) % size
    cols = (np.arange(size) - dx[:, None]) % size
    shifted = templates[labels[:, None, None, None], np.arange(channels)[None, :, None, None],
                        rows[:, None, :, None], cols[:, None, None, :]]
    scale = rng.uniform(0.5, 1.5, size=(n, 1, 1, 1))
    x = scale * shifted + 1.5 * rng.standard_normal((n, channels, size, size))
    return x.astype(np.float32), labels.astype(np.int64)


def _synthetic_regression(rng: np.random.Generator, n: int, features: int) -> tuple[np.ndarray, np.ndarray]:
    hidden = 16
    w_in = rng.standard_normal((features, hidden)) / np.sqrt(features)
    w_out = rng.standard_normal(hidden) / np.sqrt(hidden)
    w_wave = rng.standard_normal(features) / np.sqrt(features)
    x = rng.standard_normal((n, features))
    logit = 2.0 * np.tanh(2.0 * x @ w_in) @ w_out + np.sin(2.0 * x @ w_wave) + 0.1 * rng.standard_normal(n)
    # Clipping keeps float32 sigmoid values strictly inside (0, 1).
    y = 1.0 / (1.0 + np.exp(-np.clip(logit, -8.0, 8.0)))
    return x.astype(np.float32), y.astype(np.float32).reshape(n, 1)


# ------------------------------------------------------------------------ user files


def _load_file(path: Path, name: str | None, seed: int, block_size: int | None, test_fraction: float,
               check_values: bool, task: str, log: Callable[[str], None]) -> Dataset:
    if not path.exists():
        raise UserError(f"--data '{path}' does not exist; give an .npz, .h5/.hdf5 or .zarr file with arrays x and y "
                        "(or a directory holding x.npy and y.npy)")
    opened = _open_arrays(path, block_size)
    if ("x_test" in opened) != ("y_test" in opened):
        given, missing = ("x_test", "y_test") if "x_test" in opened else ("y_test", "x_test")
        raise UserError(f"data file '{path}' has '{given}' but no '{missing}'; give both or neither.")

    for key, tensor in opened.items():
        _check_array(path, key, tensor, opened)
    # Scanning x for NaN/inf reads all of it: done once, by the process that validates the run;
    # workers pass check_values=False and read only the labels (for the class count) and their rows.
    stats = {key: _scan(path, key, tensor) for key, tensor in opened.items()
             if check_values or key in ("y", "y_test")}

    x, y = opened["x"], opened["y"]
    task = decide_task(task, np.issubdtype(y.dtype, np.integer), np.dtype(y.dtype).name, y.shape, f"y of '{path}'",
                       log)
    if task == "classification" and not np.issubdtype(y.dtype, np.integer):
        for key in ("y", "y_test"):
            if key in opened:
                _check_whole_labels(path, key, opened[key])
    num_classes = _num_classes(path, stats) if task == "classification" else None
    if num_classes is not None and check_values:  # (said once, by the process that validates the run)
        present = np.unique(np.concatenate([np.unique(y.block(i)) for i in range(y.n_blocks)]))
        say_missing_classes(present, num_classes, f"array 'y' in '{path}'", log)
    if "x_test" in opened:
        x_train, y_train, x_test, y_test = x, y, opened["x_test"], opened["y_test"]
    else:
        x_train, y_train, x_test, y_test = _split(x, y, test_fraction, seed, str(path))
        log(holding_out_line(f"'{path}' has no x_test/y_test", len(y_test), len(y), test_fraction))
    label = name if name is not None else path.stem
    return Dataset(x_train, y_train, x_test, y_test, task, num_classes, x.shape[1:], label)


def _open_arrays(path: Path, block_size: int | None) -> dict[str, DSTensor]:
    """The arrays among ``ARRAY_NAMES`` that ``path`` holds, opened lazily; ``x`` and ``y`` must be there."""
    if path.is_dir() and not path.name.lower().endswith(".zarr"):
        held = sorted(p.name for p in path.iterdir())
        if "x.npy" not in held or "y.npy" not in held:
            raise UserError(_not_a_data_directory(path, held))
        return {
            key: DSTensor.from_file(path / f"{key}.npy", None, block_size)
            for key in ARRAY_NAMES
            if f"{key}.npy" in held
        }
    if path.suffix.lower() == ".npy":
        raise UserError(
            f"data file '{path}' holds a single array; put x.npy and y.npy (optionally x_test.npy, y_test.npy) "
            "in one directory and give that directory as --data."
        )
    held = list_arrays(path)
    for needed in ("x", "y"):
        if needed not in held:
            raise UserError(f"data file '{path}' has no array '{needed}'; it holds: {', '.join(held) or 'no arrays'}.")
    return {key: DSTensor.from_file(path, key, block_size) for key in ARRAY_NAMES if key in held}


DIRECTORY_FORMS = ("--data DIR takes a folder of images with one subfolder per class (DIR/CLASS/IMAGE.png, or "
                   "DIR/train/CLASS/... and DIR/test/CLASS/...) or a folder holding x.npy and y.npy")


def _not_a_data_directory(path: Path, held: list[str]) -> str:
    """Why the directory `path` (holding `held`) is neither an image folder nor arrays: what it was read as and
    the forms that are valid, naming the class subfolders that hold no images."""
    if not held:
        return f"data directory '{path}' is empty; {DIRECTORY_FORMS}."
    if any(name in held for name in ("x.npy", "y.npy")):
        return (f"data directory '{path}' needs x.npy and y.npy (optionally x_test.npy and y_test.npy); "
                f"it holds: {', '.join(held)}.")
    top = path / "train" if (path / "train").is_dir() else path
    folders = [directory.name for directory in class_dirs(top)]
    if folders:  # meant as an image folder, but no subfolder holds an image (else it would have been read as one)
        where = f"'{top}'" if top == path else f"'{path}' (its train/ subfolder)"
        return (f"data directory {where} looks like an image folder, but its class subfolders hold no images "
                f"({', '.join(sorted(IMAGE_SUFFIXES))}): {', '.join(folders)}; {DIRECTORY_FORMS}.")
    return f"data directory '{path}' holds neither class subfolders of images nor x.npy and y.npy (it holds: " \
           f"{', '.join(held)}); {DIRECTORY_FORMS}."


TASKS = {"classify": "classification", "regress": "regression"}


def decide_task(asked: str, integer: bool, dtype_name: str, shape: tuple, what: str,
                log: Callable[[str], None]) -> str:
    """'classification' or 'regression': as --task asks, else integer labels classify and float targets
    regress (said in one line, since a float label array is a common slip)."""
    if asked in TASKS:
        task = TASKS[asked]
        if task == "classification" and len(shape) != 1:
            raise UserError(f"--task classify needs one class label per sample, but {what} has shape {tuple(shape)}")
        return task
    if integer:
        return "classification"
    log(f"dptrain: {what} is {dtype_name}: treating this as regression (loss mse unless --loss names one); save "
        "integer labels (or give --task classify) for classification")
    return "regression"


def _check_whole_labels(path: Path, key: str, tensor: DSTensor) -> None:
    """--task classify on float labels: each must be a whole number (it becomes a class index)."""
    for i in range(tensor.n_blocks):
        fraction = first_fraction(tensor.block(i))
        if fraction is not None:
            raise UserError(f"--task classify: array '{key}' in '{path}' holds the label {fraction!r}, "
                            "which is not a whole number; class labels must be 0..C-1")


def first_fraction(labels: np.ndarray) -> float | None:
    """The first label that is not a whole number (it cannot be a class index), or None."""
    fractional = labels[labels != np.round(labels)]
    return fractional.flat[0].item() if fractional.size else None


def _check_array(path: Path, key: str, tensor: DSTensor, opened: dict[str, DSTensor]) -> None:
    if len(tensor) == 0:
        raise UserError(f"array '{key}' in '{path}' is empty (0 samples); it needs at least one sample.")
    if key in ("y", "y_test") and len(tensor.shape) > 2:
        raise UserError(f"array '{key}' in '{path}' has shape {tensor.shape}; labels or targets must be (n,) or (n, k).")
    if not (np.issubdtype(tensor.dtype, np.integer) or np.issubdtype(tensor.dtype, np.floating)):
        raise UserError(f"array '{key}' in '{path}' has dtype {tensor.dtype}; use an integer or floating dtype.")
    if key in ("y", "y_test") and np.issubdtype(tensor.dtype, np.integer) and len(tensor.shape) != 1:
        raise UserError(f"array '{key}' in '{path}' has shape {tensor.shape}; integer class labels must be 1-D, shape (n,).")
    partner = {"x": "y", "x_test": "y_test"}.get(key)
    if partner is not None and len(opened[partner]) != len(tensor):
        raise UserError(
            f"data file '{path}' has {len(tensor)} samples in '{key}' but {len(opened[partner])} in '{partner}'; "
            "they must match."
        )
    train = {"x_test": "x", "y_test": "y"}.get(key)
    if train is None:
        return
    if tensor.shape[1:] != opened[train].shape[1:]:
        raise UserError(
            f"array '{key}' in '{path}' has per-sample shape {tensor.shape[1:]} but '{train}' has "
            f"{opened[train].shape[1:]}; they must match."
        )
    if np.issubdtype(tensor.dtype, np.integer) != np.issubdtype(opened[train].dtype, np.integer):
        raise UserError(
            f"array '{key}' in '{path}' has dtype {tensor.dtype} but '{train}' has {opened[train].dtype}; "
            "both must be integer labels or both floating."
        )


def _scan(path: Path, key: str, tensor: DSTensor) -> tuple[float, float]:
    """(min, max) of an array, read block by block; rejects NaN and infinite values."""
    bad, low, high = 0, np.inf, -np.inf
    for i in range(tensor.n_blocks):
        block = tensor.block(i)
        if np.issubdtype(block.dtype, np.floating):
            finite = np.isfinite(block)
            bad += int(block.size - np.count_nonzero(finite))
            block = block[finite]
        if block.size:
            low, high = min(low, block.min()), max(high, block.max())
    if bad:
        raise UserError(f"array '{key}' in '{path}' has {bad} NaN or infinite values; remove or replace them.")
    return float(low), float(high)


def _num_classes(path: Path, stats: dict[str, tuple[float, float]]) -> int:
    for key in ("y", "y_test"):
        if key in stats and stats[key][0] < 0:
            raise negative_label(f"array '{key}' in '{path}'", stats[key][0])
    train_max = int(stats["y"][1])
    if "y_test" in stats and stats["y_test"][1] > train_max:
        raise unseen_label(f"array 'y_test' in '{path}'", stats["y_test"][1], "'y'", train_max)
    if train_max < 1:
        raise UserError(f"array 'y' in '{path}' has only class 0; classification needs at least 2 classes.")
    return train_max + 1


def _split(
    x: DSTensor, y: DSTensor, test_fraction: float, seed: int, source: str
) -> tuple[DSTensor, DSTensor, DSTensor, DSTensor]:
    """Split off ``round(test_fraction * n)`` test samples chosen by ``seed`` (dptrain.data.holdout), refusing
    a split that leaves either part empty; both parts keep source order."""
    n = len(x)
    keep, hold = hold_out(n, seed, test_fraction)
    n_test = len(hold)
    if not 0 < n_test < n:
        raise UserError(
            f"test_fraction {test_fraction} of the {n} samples of '{source}' leaves {n_test} test and "
            f"{n - n_test} training samples; both need at least one."
        )
    test, train = np.sort(hold), np.sort(keep)
    return x.subset(train), y.subset(train), x.subset(test), y.subset(test)
