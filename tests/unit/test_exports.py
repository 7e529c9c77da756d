import isthmus


def test_all_is_complete_and_resolves():
    public = {name for name in vars(isthmus) if not name.startswith("_")}
    modules = {name for name in public if type(getattr(isthmus, name)).__name__ == "module"}
    assert set(isthmus.__all__) - {"__version__"} == public - modules
    for name in isthmus.__all__:
        assert hasattr(isthmus, name)
