"""JSON schemas the structured-output tests decode against, engine and gateway alike: each
bounds its strings and arrays, so that every output closes within a few tokens."""

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
COLOR = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}},
    "required": ["color"],
    "additionalProperties": False,
}
SHORT_STRINGS = {
    "type": "array",
    "items": {"type": "string", "maxLength": 16},
    "minItems": 1,
    "maxItems": 3,
}
