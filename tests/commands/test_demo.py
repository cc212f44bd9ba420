from layerstream.commands import demo


def test_demo_trains_a_streamed_model_and_its_loss_falls(capsys):
    result = demo.main(["--steps", "30", "--device", "cpu"])
    assert result["last_loss"] < result["first_loss"] - 1.0
    assert result["stats"]["layer_loads"] > 30
    out = capsys.readouterr().out
    assert out.startswith("layerstream demo on cpu: python "), "its log names what it ran on"
    for name in ("torch", "transformers", "peft"):
        assert f" {name} " in out.splitlines()[0]


def test_result_versions_name_each_library_installed():
    from importlib import metadata

    from layerstream.system.versions import versions

    found = versions()
    assert found["torch"] == metadata.version("torch") and found["cpus"] >= 1
    assert {"python", "layerstream", "transformers", "peft", "accelerate"} <= set(found)
