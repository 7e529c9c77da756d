import isthmus


def test_all_is_complete_and_resolves():
    public = {name for name in vars(isthmus) if not name.startswith("_")}
    modules = {name for name in public if type(getattr(isthmus, name)).__name__ == "module"}
    assert set(isthmus.__all__) - {"__version__"} == public - modules
    for name in isthmus.__all__:
        assert hasattr(isthmus, name)


def test_the_error_tree_names_every_error_class_with_its_parent():
    """errors.py's docstring draws the tree; every IsthmusError subclass of the package is in
    it, under its parent (the tree's indentation), with its status code where it has one."""
    import importlib
    import pkgutil
    import re

    from isthmus import errors

    for module in pkgutil.walk_packages(isthmus.__path__, "isthmus."):
        if module.name.startswith("isthmus._bootstrap"):
            continue
        importlib.import_module(module.name)
    classes: set[type] = set()
    todo = [errors.IsthmusError]
    while todo:
        cls = todo.pop()
        classes.add(cls)
        todo.extend(cls.__subclasses__())
    drawn: dict[str, int] = {}  # class name -> the column its name starts at
    parents: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in (errors.__doc__ or "").splitlines():
        found = re.match(r"^(\s*(?:\|\s*)*(?:\+-- )?)([A-Z]\w+)\s", line)
        if not found or found.group(2) not in {c.__name__ for c in classes}:
            continue
        name, column = found.group(2), len(found.group(1))
        drawn[name] = column
        while stack and stack[-1][0] >= column:
            stack.pop()
        if stack:
            parents[name] = stack[-1][1]
        stack.append((column, name))
    assert {c.__name__ for c in classes} == set(drawn), "errors.py's tree is out of date"
    for cls in classes:
        if cls is errors.IsthmusError or cls.__name__ == "PlatformUnavailable":
            continue
        assert parents.get(cls.__name__) == cls.__base__.__name__, cls
