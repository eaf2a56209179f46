"""Built-in models and user model factories: shapes, training, DDP/autocast compatibility, errors."""

from __future__ import annotations

import importlib
import sys
import textwrap
import uuid

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dptrain.errors import UserError
from dptrain.models import MODEL_NAMES, build_model, check_output_shape
from dptrain.models.nfnet import ScaledGELU, WSConv2d


def count_parameters(model: torch.nn.Module) -> int:
    """Scalar parameters, each shared tensor counted once."""
    return sum(p.numel() for p in model.parameters())


# (name, per-sample shape, outputs) covering each built-in model's natural inputs.
NATURAL = [
    ("mlp", (1, 8, 8), 10),
    ("mlp", (8,), 3),
    ("cnn", (1, 8, 8), 10),
    ("cnn", (3, 32, 32), 10),
    ("cnn", (3, 13, 17), 4),
    ("resnet", (1, 8, 8), 10),
    ("resnet", (3, 32, 32), 10),
    ("nfnet", (1, 8, 8), 10),
    ("nfnet", (3, 32, 32), 10),
    ("mlp-regression", (8,), 1),
    ("cnn1d", (1, 40), 10),
    ("cnn1d", (40,), 10),
    ("cnn1d", (3, 7), 4),
]
ONE_PER_MODEL = [next(case for case in NATURAL if case[0] == name) for name in MODEL_NAMES]


@pytest.fixture(autouse=True)
def _two_threads():
    # Tiny models gain nothing from threads, and oversubscribed threads stall on busy CI machines.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize(("name", "shape", "outputs"), NATURAL)
def test_builtin_model_gives_one_output_row_per_sample_and_backpropagates_to_every_parameter(name, shape, outputs):
    model = build_model(name, shape, outputs)
    out = model(torch.randn(4, *shape))
    assert out.shape == (4, outputs)
    out.float().pow(2).mean().backward()
    # DDP (find_unused_parameters=False) needs every parameter in the graph of each forward.
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(("name", "shape", "outputs"), ONE_PER_MODEL)
def test_builtin_model_runs_under_cpu_bf16_autocast(name, shape, outputs):
    model = build_model(name, shape, outputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(4, *shape))
    out.float().sum().backward()
    assert out.shape == (4, outputs)
    assert torch.isfinite(out.float()).all()


def test_every_builtin_model_trains_under_ddp_without_unused_parameters(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for name, shape, outputs in ONE_PER_MODEL:
            model = nn.parallel.DistributedDataParallel(build_model(name, shape, outputs))
            # An unused parameter would make DDP fail at the start of the second iteration.
            for _ in range(2):
                model(torch.randn(4, *shape)).sum().backward()
    finally:
        dist.destroy_process_group()


def test_mlp_regression_has_the_reference_layer_sizes_and_a_sigmoid_output():
    model = build_model("mlp-regression", (8,), 1)
    sizes = [(layer.in_features, layer.out_features) for layer in model.modules() if isinstance(layer, nn.Linear)]
    assert sizes == [(8, 128), (128, 256), (256, 512), (512, 256), (256, 128), (128, 1)]
    out = model(torch.randn(16, 8) * 100)
    assert ((out >= 0) & (out <= 1)).all()


def test_count_parameters_of_default_mlp_on_digits():
    assert count_parameters(build_model("mlp", (1, 8, 8), 10)) == (64 * 128 + 128) + (128 * 64 + 64) + (64 * 10 + 10)


def test_options_change_the_architecture():
    wide = build_model("cnn", (1, 8, 8), 10, options={"width": 8})
    assert count_parameters(wide) < count_parameters(build_model("cnn", (1, 8, 8), 10))
    mlp = build_model("mlp", (8,), 2, options={"hidden": [5]})
    assert [m.out_features for m in mlp.modules() if isinstance(m, nn.Linear)] == [5, 2]


@pytest.mark.parametrize("name", ["resnet", "nfnet"])
def test_resnet_style_depth_must_be_6n_plus_2(name):
    deeper = build_model(name, (3, 8, 8), 10, options={"depth": 14})
    assert count_parameters(deeper) > count_parameters(build_model(name, (3, 8, 8), 10))
    with pytest.raises(UserError, match=r"'depth'.* 10, .*8, 14, 20, 32 or 56"):
        build_model(name, (3, 8, 8), 10, options={"depth": 10})


def test_nfnet_has_no_normalisation_layers():
    model = build_model("nfnet", (3, 32, 32), 10, options={"depth": 14})
    norm_types = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm)
    assert not [m for m in model.modules() if isinstance(m, norm_types)]
    assert not list(model.buffers())
    assert any(isinstance(m, WSConv2d) for m in model.modules())


def test_nfnet_building_blocks_preserve_unit_variance():
    torch.manual_seed(0)
    assert ScaledGELU()(torch.randn(200_000)).var().item() == pytest.approx(1.0, abs=0.02)
    conv = WSConv2d(16, 32, 3)
    weight = conv.standardized_weight().detach()
    assert weight.mean(dim=(1, 2, 3)).abs().max().item() < 1e-6
    assert (weight.var(dim=(1, 2, 3), unbiased=False) * 16 * 9).mean().item() == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_same_seed_builds_identical_weights(name):
    shape = (8,) if name == "mlp-regression" else (1, 40) if name == "cnn1d" else (3, 8, 8)

    def weights(seed):
        torch.manual_seed(seed)
        return build_model(name, shape, 2).state_dict()

    first, again, other = weights(0), weights(0), weights(1)
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert any(not torch.equal(first[key], other[key]) for key in first)


def test_image_models_reject_flat_samples_and_suggest_mlp():
    with pytest.raises(UserError, match=r"'cnn'.*\(8,\).*mlp"):
        build_model("cnn", (8,), 2)


def test_cnn1d_is_mnist1ds_baseline_cnn():
    # Greydanus 2020: conv(1->25, k5 s2 p1), conv(25->25, k3 s2 p1) twice, ReLUs, linear(125 -> 10);
    # 40 steps -> 19 -> 10 -> 5, so 150 + 1,900 + 1,900 + 1,260 = 5,210 parameters.
    model = build_model("cnn1d", (1, 40), 10)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv1d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.stride, c.padding) for c in convs] == [
        (1, 25, (5,), (2,), (1,)), (25, 25, (3,), (2,), (1,)), (25, 25, (3,), (2,), (1,))]
    assert [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)] == [(125, 10)]
    assert count_parameters(model) == 5210
    assert count_parameters(build_model("cnn1d", (1, 40), 10, options={"channels": 8})) == (
        1 * 8 * 5 + 8 + 2 * (8 * 8 * 3 + 8) + 8 * 5 * 10 + 10)


def test_cnn1d_rejects_images_and_too_short_sequences():
    with pytest.raises(UserError, match=r"^model 'cnn1d' needs sequences shaped \(C, L\) or \(L,\), but the data's "
                                        r"samples have shape \(1, 8, 8\); use --model cnn for images$"):
        build_model("cnn1d", (1, 8, 8), 10)
    with pytest.raises(UserError, match=r"at least 3 steps.*\(1, 2\)"):
        build_model("cnn1d", (1, 2), 10)
    assert build_model("cnn1d", (1, 3), 10)(torch.zeros(2, 1, 3)).shape == (2, 10)


def test_unknown_model_name_suggests_the_closest():
    with pytest.raises(UserError, match=r"'resnt'.*did you mean 'resnet'.*mlp, cnn"):
        build_model("resnt", (3, 8, 8), 10)


def test_unknown_or_bad_options_name_the_valid_ones():
    with pytest.raises(UserError, match=r"unknown option 'widht' for model 'cnn'; valid options are width"):
        build_model("cnn", (1, 8, 8), 10, options={"widht": 8})
    with pytest.raises(UserError, match=r"'width' for model 'resnet' is -4.*positive integer"):
        build_model("resnet", (1, 8, 8), 10, options={"width": -4})
    with pytest.raises(UserError, match=r"'hidden' for model 'mlp' is 'big'.*list of positive integers"):
        build_model("mlp", (8,), 2, options={"hidden": "big"})


def test_bad_sample_shape_or_output_count_is_a_user_error():
    with pytest.raises(UserError, match=r"sample shape \(\)"):
        build_model("mlp", (), 2)
    with pytest.raises(UserError, match=r"outputs is 0"):
        build_model("mlp", (8,), 0)


USER_MODULE = """
    import math
    from torch import nn

    seen = {}

    def with_keywords(input_shape, num_outputs, hidden=16):
        return nn.Sequential(
            nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU(), nn.Linear(hidden, num_outputs)
        )

    def without_keywords():
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

    def with_kwargs(**kwargs):
        seen.update(kwargs)
        return nn.Linear(8, kwargs["num_outputs"])

    def raising(input_shape, num_outputs):
        raise ValueError("needs 3 channels")

    def not_a_module():
        return 42

    def five_outputs():
        return nn.Sequential(nn.Flatten(), nn.Dropout(0.5), nn.Linear(64, 5))
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Name of a freshly written importable module holding USER_MODULE's factories."""
    # A unique name per test so no test imports a module cached by another.
    name = f"dptrain_test_user_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield name
    sys.modules.pop(name, None)


def test_user_factory_gets_data_keywords_and_options_only_if_it_declares_them(user_module):
    model = build_model(f"{user_module}:with_keywords", (1, 8, 8), 10, options={"hidden": 7})
    assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    assert model[1].out_features == 7
    assert build_model(f"{user_module}:without_keywords", (1, 8, 8), 10)(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    build_model(f"{user_module}:with_kwargs", (8,), 3, options={"depth": 2})
    assert sys.modules[user_module].seen == {"input_shape": (8,), "num_outputs": 3, "depth": 2}


def test_user_factory_rejects_options_it_does_not_declare(user_module):
    with pytest.raises(UserError, match=r"does not accept option 'width'.*hidden"):
        build_model(f"{user_module}:with_keywords", (8,), 2, options={"width": 3})


def test_user_model_from_a_missing_module(user_module):
    with pytest.raises(UserError, match=r"cannot import module 'no_such_pkg.nets' for --model no_such_pkg.nets:f: "):
        build_model("no_such_pkg.nets:f", (8,), 2)


def test_user_model_with_a_missing_attribute_lists_the_available_ones(user_module):
    with pytest.raises(UserError, match=rf"'{user_module}' has no attribute 'nope'.*raising.*with_keywords"):
        build_model(f"{user_module}:nope", (8,), 2)


def test_user_factory_that_raises(user_module):
    with pytest.raises(UserError, match=rf"model factory {user_module}:raising raised ValueError: needs 3 channels"):
        build_model(f"{user_module}:raising", (8,), 2)


def test_user_factory_that_returns_no_module(user_module):
    with pytest.raises(UserError, match=r"returned a value of type int, but it must return a torch.nn.Module"):
        build_model(f"{user_module}:not_a_module", (8,), 2)


@pytest.fixture
def model_file(tmp_path, monkeypatch):
    """A project directory, the working directory, holding mymodels.py (USER_MODULE's factories and one that
    imports widths.py beside it); what loading it adds to sys.modules and sys.path is removed afterwards."""
    from dptrain import user_code

    project = tmp_path / "project"
    project.mkdir()
    (project / "mymodels.py").write_text(textwrap.dedent(USER_MODULE) + textwrap.dedent("""
        def uses_sibling(input_shape, num_outputs):
            from widths import HIDDEN
            return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), HIDDEN), nn.Linear(HIDDEN, num_outputs))
    """))
    (project / "widths.py").write_text("HIDDEN = 5\n")
    monkeypatch.chdir(project)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(user_code, "_FILE_MODULES", {})
    before = set(sys.modules)
    yield project
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_user_model_from_a_python_file(model_file):
    model = build_model("./mymodels.py:with_keywords", (1, 8, 8), 10, options={"hidden": 7})
    assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 10) and model[1].out_features == 7
    # The same file by another path is the same module, loaded once; without ./ it is a file all the same.
    from dptrain.models.user import load_factory
    assert load_factory(f"{model_file}/mymodels.py:with_kwargs") is load_factory("mymodels.py:with_kwargs")
    # It imports the modules beside it, as under `python mymodels.py`.
    assert build_model("./mymodels.py:uses_sibling", (8,), 2)[1].out_features == 5


def test_user_model_from_a_missing_or_broken_python_file(model_file):
    with pytest.raises(UserError, match=r"^--model ./nets.py:make: the file './nets.py' does not exist; give the "
                                        r"path of a Python file \(relative to .*/project\) or package.module:function$"):
        build_model("./nets.py:make", (8,), 2)
    (model_file / "broken.py").write_text("import no_such_module_for_dptrain\n")
    with pytest.raises(UserError, match=r"^cannot import the file 'broken.py' for --model broken.py:f: "
                                        r"ModuleNotFoundError: No module named 'no_such_module_for_dptrain'$"):
        build_model("broken.py:f", (8,), 2)
    with pytest.raises(UserError, match=r"module './mymodels.py' has no attribute 'nope'.*with_keywords"):
        build_model("./mymodels.py:nope", (8,), 2)


def test_malformed_user_model_name():
    with pytest.raises(UserError, match=r"package.module:factory"):
        build_model("pkg.mod:", (8,), 2)


def test_check_output_shape_catches_a_model_that_does_not_fit_the_data(user_module):
    model = build_model(f"{user_module}:five_outputs", (1, 8, 8), 10)
    model.train()
    model[1].eval()
    expected = r"model output shape \(2, 5\) does not match the data: expected \(2, 10\) for 10 outputs"
    with pytest.raises(UserError, match=expected):
        check_output_shape(model, (1, 8, 8), 10)
    # Each submodule's mode comes back as it was, including a deliberately mixed one.
    assert model.training and model[0].training and not model[1].training
    check_output_shape(model, (1, 8, 8), 5)
    with pytest.raises(UserError, match=r"model forward on a batch of samples shaped \(3, 8, 8\) raised RuntimeError"):
        check_output_shape(model, (3, 8, 8), 5)


def test_check_output_shape_accepts_every_builtin_model():
    for name, shape, outputs in NATURAL:
        check_output_shape(build_model(name, shape, outputs), shape, outputs)


def test_mlp_learns_sklearn_digits():
    datasets = pytest.importorskip("sklearn.datasets")
    model_selection = pytest.importorskip("sklearn.model_selection")
    features, labels = datasets.load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = model_selection.train_test_split(
        features, labels, test_size=0.2, random_state=0
    )
    x_train = torch.tensor(x_train / 16, dtype=torch.float32).reshape(-1, 1, 8, 8)
    x_test = torch.tensor(x_test / 16, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y_train, y_test = torch.tensor(y_train), torch.tensor(y_test)

    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(5):
        for batch in torch.randperm(len(x_train)).split(32):
            optimizer.zero_grad()
            F.cross_entropy(model(x_train[batch]), y_train[batch]).backward()
            optimizer.step()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
    assert accuracy >= 0.9
