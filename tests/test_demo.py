from layerstream import demo


def test_demo_trains_a_streamed_model_and_its_loss_falls(capsys):
    result = demo.main(["--steps", "30", "--device", "cpu"])
    assert result["last_loss"] < result["first_loss"] - 1.0
    assert result["stats"]["layer_loads"] > 30
