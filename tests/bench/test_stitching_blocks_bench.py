"""The transformer-blocks bench's report (the bench itself runs on a GPU)."""

from stitchflow.bench import stitching_blocks


def test_markdown_reports_medians_ratios_and_the_rounds_method():
    row = {"app": "bert", "shapes": [[1, 512, 768]], "eager us": 255.0, "torch.compile us": 463.0,
           "backend=stitchflow us": 98.0, "stitchflow.compile us": 99.0, "torch.compile err": 4e-3,
           "backend=stitchflow err": 2e-3, "stitchflow.compile err": 2e-3,
           "backend=stitchflow vs compile": 463 / 98, "stitchflow.compile vs compile": 463 / 99,
           "eager rounds us": [255.0, 260.1, 250.2]}
    slow = dict(row, app="llama", **{"backend=stitchflow vs compile": 0.9, "stitchflow.compile vs compile": None})
    info = {"command": "cmd", "device": "GPU", "date": "today", "torch": "2", "triton": "3", "dtype": "bfloat16",
            "size": "default"}
    text = stitching_blocks.markdown([row, slow], info)
    assert f"median of {stitching_blocks.ROUNDS} rounds (the runners timed in turn)" in text
    assert "| bert | 1x512x768 | 255 | 463 | - | 98 | 99 | **4.72x faster** | **4.68x faster** | n/a | 4.0e-03 |" in text
    assert "0.90x (11.1% slower) | n/a |" in text
    graphed = dict(row, **{"torch.compile reduce-overhead us": 120.0, "stitchflow.compile vs reduce-overhead": 120 / 99})
    assert "| 120 | 98 | 99 |" in stitching_blocks.markdown([graphed], info) and "**1.21x faster** | 4.0e-03" in \
        stitching_blocks.markdown([graphed], info)
    assert text.startswith("## Transformer blocks end to end") and "build_model(app, size=\"default\")" in text
