"""Our parameters under the export's PyTorch names and back (models/torch_names.py): the
round trip gives every parameter of every pretraining model back, and a name or size that
does not fit is reported rather than read into the wrong place."""

import jax
import numpy as np
import pytest

from maelm_jax.models import torch_names

from tiny_config import tiny_config, tiny_model

pytestmark = pytest.mark.tier("unit")


@pytest.mark.parametrize("objective", ["mlm", "maelm"])
def test_the_round_trip_gives_every_parameter_back(objective):
    _, _, params = tiny_model(tiny_config(objective))
    state = torch_names.state_dict(params)
    assert state["encoder.stack.layers.1.attention.query.weight"].shape == (32, 32)
    back, missing = torch_names.from_state_dict(state, params)
    assert missing == []
    got, want = (jax.tree_util.tree_leaves_with_path(t) for t in (back, params))
    got, want = list(got), list(want)
    assert [k for k, _ in got] == [k for k, _ in want]
    for (name, a), (_, b) in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, np.asarray(b), err_msg=jax.tree_util.keystr(name))


def test_what_is_absent_or_of_another_size_is_reported():
    _, _, params = tiny_model(tiny_config("mlm"))
    state = torch_names.state_dict(params)
    del state["lm_head.bias"]
    back, missing = torch_names.from_state_dict(state, params)
    assert missing == ["lm_head.bias"] and "bias" not in back["lm_head"]
    state["encoder.ln_embed.weight"] = np.zeros(48, np.float32)
    with pytest.raises(ValueError, match=r"encoder.ln_embed.weight has shape \(48,\), which "
                       r"does not give \(32,\)"):
        torch_names.from_state_dict(state, params)
