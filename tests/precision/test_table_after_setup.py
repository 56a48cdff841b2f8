"""``Precision.setup`` leaves the table it resolved on the object (what FSDP2's islands are read
from, no second set-up), and a layer's format change while training refreshes it."""
import mixprec as mp


def test_setup_keeps_its_table_and_a_format_switch_refreshes_it():
    precision = mp.Precision("bf16-mixed")
    assert precision.layers.table is None
    model, _ = precision.setup(mp.Transformer.from_preset("tiny", num_layers=1))
    assert precision.layers.table == precision.resolve(model)
    assert "blocks.0.ln1" in precision.layers.table.islands
    precision.layers.set_format(model, "blocks.0.attn.qkv", "fp32")
    assert precision.layers.table["blocks.0.attn.qkv"].compute == "fp32"
