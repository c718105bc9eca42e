"""JSON Schema walks for structured output: OpenAI's strict reading of object schemas (`closed`), references
mapped and rebased, and the parts of a schema whose references loop cut where no finite value satisfies them
(`cut_endless`). Pure functions of the schema; llguidance only judges whether a part is satisfiable."""

from __future__ import annotations

# one JSON layout (`{"a": 1, "b": [2, 3]}`, as json.dumps writes it): free whitespace lets a model pad forever;
# a schema's own "x-guidance" options override it
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# subschema places: keys holding one schema, keys holding a list of them (allOf's are parts of one object)
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames", "additionalProperties",
        "unevaluatedProperties", "unevaluatedItems")
_MANY = ("anyOf", "oneOf", "prefixItems", "items")
_OPEN = ("additionalProperties", "unevaluatedProperties", "patternProperties", "allOf", "anyOf", "oneOf", "$ref",
         "if", "dependentSchemas")


def closed(schema, _part: bool = False):
    """`schema` with OpenAI's strict semantics (and llama-server's): an object schema that declares `properties`
    allows those only, unless it says otherwise (`additionalProperties`, `patternProperties`...). JSON Schema's
    default would let a model add keys until the token limit cuts the JSON. Left as they are: objects that
    declare no properties (any object), and objects built from parts (allOf, a `$ref` beside properties, anyOf /
    oneOf beside them), where a key one part declares would be extra to another."""
    if isinstance(schema, list):
        return [closed(x) for x in schema]
    if not isinstance(schema, dict):
        return schema

    def other(k, v):
        if k == "allOf" and isinstance(v, list):
            return [closed(x, _part=True) for x in v]
        return closed(v) if k in _ONE or k in _MANY else v

    out = _each_key(schema, closed, other)
    if "properties" in out and not _part and not any(k in out for k in _OPEN):
        out["additionalProperties"] = False
    return out


# keywords whose values are JSON data, not schemas (a "$ref" key in a `const` is data); and keywords that map names
# to schemas (a property may be called "$ref" or "enum")
_DATA = frozenset({"const", "enum", "default", "examples"})
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _each_key(node: dict, named, other) -> dict:
    """A copy of the schema object `node`: JSON data kept as it is, each schema of a name-to-schema map through
    named(schema), every other key's value through other(key, value)."""
    out = {}
    for k, v in node.items():
        if k in _DATA:
            out[k] = v
        elif k in _NAMED and isinstance(v, dict):
            out[k] = {name: named(sub) for name, sub in v.items()}
        else:
            out[k] = other(k, v)
    return out


def map_refs(node, fn):
    """A copy of the JSON Schema `node` in which each subschema that holds a `$ref` is replaced by fn(subschema)
    (its own subschemas mapped first). A subschema with its own `$id` is a resource of its own, whose references
    resolve against it: it is kept as it is."""
    if isinstance(node, list):
        return [map_refs(x, fn) for x in node]
    if not isinstance(node, dict) or "$id" in node:
        return node
    out = _each_key(node, lambda sub: map_refs(sub, fn), lambda k, v: map_refs(v, fn))
    return fn(out) if isinstance(out.get("$ref"), str) else out


def rebase(schema, at: str):
    """`schema` as a part of a larger schema, at the JSON pointer `at` there: its local references ("#",
    "#/$defs/...", "#/properties/...") point at the same places under `at`, so its `$defs` / `definitions` are
    found where they now are (a pointer names a place in the whole document, and llguidance reads the whole
    grammar's schema as the document)."""
    def move(sub):
        ref = sub["$ref"]
        return {**sub, "$ref": "#" + at + ref[1:]} if ref == "#" or ref.startswith("#/") else sub

    return map_refs(schema, move)


def _pointer(ref: str) -> tuple[str, ...] | None:
    """The keys a local JSON pointer reference ("#", "#/$defs/A") follows; None for any other reference (an
    anchor, another document)."""
    from urllib.parse import unquote

    if ref == "#":
        return ()
    if not ref.startswith("#/"):
        return None
    return tuple(unquote(k).replace("~1", "/").replace("~0", "~") for k in ref[2:].split("/"))


def _at(schema, path: tuple[str, ...]):
    node = schema
    for k in path:
        if isinstance(node, list) and k.isdigit() and int(k) < len(node):
            node = node[int(k)]
        elif isinstance(node, dict) and k in node:
            node = node[k]
        else:
            return None
    return node if isinstance(node, (dict, bool)) else None


def _nested_id(node, top: bool = True) -> bool:
    """Whether a subschema below the top sets its own `$id` (references inside it resolve against it)."""
    if isinstance(node, list):
        return any(_nested_id(x, False) for x in node)
    if not isinstance(node, dict):
        return False
    if "$id" in node and not top:
        return True
    return any(_nested_id(list(v.values()) if k in _NAMED and isinstance(v, dict) else v, False)
               for k, v in node.items() if k not in _DATA)


def cut_endless(schema) -> tuple[dict, str | None]:
    """(schema, None) where no local reference loops. Where references loop, which parts have a finite value is
    found as a least fixpoint (a grammar's productive rules): a part is satisfiable when llguidance accepts it with
    each reference inside it read as "any value" if its target is already known satisfiable and as `false`
    otherwise; repeated until nothing changes. Then (the schema with each reference to a part that is not
    satisfiable set to `false`, None), or (schema, the reference) when the schema itself is not satisfiable.
    References that are no local pointers, or a nested `$id`, leave the schema to llguidance as it is."""
    import graphlib

    import llguidance

    if _nested_id(schema):
        return schema, None
    doc = {k: v for k, v in schema.items() if k != "$id"}  # the top's own `$id` is the document's: pointers hold
    parts = {(): doc}  # the schema and each place a reference points at, by path
    needs: dict[tuple, set] = {}  # part -> the places its references point at
    names: dict[tuple, str] = {}  # place -> a reference that names it, for the message
    todo = [()]
    while todo:
        path = todo.pop()
        found: set[tuple] = set()

        def note(sub):
            target = _pointer(sub["$ref"])
            found.add(target)
            names.setdefault(target, sub["$ref"])
            return sub

        map_refs(parts[path], note)
        if None in found:
            return schema, None
        needs[path] = found
        for t in found - parts.keys():
            part = _at(doc, t)
            if part is None:
                return schema, None
            parts[t] = part
            todo.append(t)
    try:
        graphlib.TopologicalSorter(needs).prepare()
        return schema, None  # no loop: llguidance reports an unsatisfiable definition itself
    except graphlib.CycleError:
        pass

    root_options = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}

    def read_as(good):
        return lambda sub: {k: v for k, v in sub.items() if k != "$ref"} if _pointer(sub["$ref"]) in good else False

    def satisfiable(part) -> bool:
        if isinstance(part, bool):
            return part
        try:
            g = llguidance.LLMatcher.grammar_from_json_schema(part, defaults={**JSON_STYLE, **root_options})
            return not llguidance.LLMatcher.validate_grammar_with_warnings(g)[0]
        except ValueError:
            return False

    users: dict[tuple, set] = {p: set() for p in parts}
    for p, ts in needs.items():
        for t in ts:
            users[t].add(p)
    good: set[tuple] = set()
    queue = list(parts)
    while queue:
        p = queue.pop()
        if p not in good and satisfiable(map_refs(parts[p], read_as(good))):
            good.add(p)
            queue.extend(users[p] - good)
    if () not in good:
        bad = sorted(t for t in needs[()] if t not in good) or [()]
        return schema, names.get(bad[0], "#")
    cut = map_refs(doc, lambda sub: sub if _pointer(sub["$ref"]) in good else False)
    return ({**cut, "$id": schema["$id"]} if "$id" in schema else cut), None
