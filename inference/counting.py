"""Prompt tokens as an OpenAI-family vendor bills them: the content's tokens plus each
message's framing, the reply's priming and what tool definitions add (the rules of OpenAI's
token-counting guide). Local models are never counted this way: their counts are the ids."""

from inference.tiktoken_offline import encoding

TOKENS_PER_MESSAGE = 3  # <|start|>{role}<|message|> ... <|end|>
TOKENS_PER_NAME = 1
REPLY_PRIMING = 3  # <|start|>assistant<|message|>
# Per model family (by encoding): what each function, its properties and enums add.
TOOL_RULES = {
    "o200k_base": {"function": 7, "properties": 3, "property": 3, "enum": -3, "enum_item": 3, "end": 12},
    "cl100k_base": {"function": 10, "properties": 3, "property": 3, "enum": -3, "enum_item": 3, "end": 12},
}


def text_tokens(text, encoding_name):
    return len(encoding(encoding_name).encode(text, disallowed_special=()))


def message_tokens(message, encoding_name):
    total = TOKENS_PER_MESSAGE
    for key, value in message.items():
        if isinstance(value, str):
            total += text_tokens(value, encoding_name)
        if key == "name":
            total += TOKENS_PER_NAME
    return total


def chat_prompt_tokens(messages, encoding_name, tools=()):
    total = REPLY_PRIMING + sum(message_tokens(m, encoding_name) for m in messages)
    return total + tools_tokens(tools, encoding_name) if tools else total


def tools_tokens(tools, encoding_name):
    rules = TOOL_RULES[encoding_name]
    return sum(function_tokens(tool["function"], rules, encoding_name) for tool in tools) + rules["end"]


def function_tokens(function, rules, encoding_name):
    total = rules["function"] + text_tokens(f"{function.get('name', '')}:{without_period(function.get('description'))}", encoding_name)
    properties = as_dict(as_dict(function.get("parameters")).get("properties"))
    if properties:
        total += rules["properties"]
    for name, schema in properties.items():
        total += rules["property"] + property_tokens(name, as_dict(schema), rules, encoding_name)
    return total


def property_tokens(name, schema, rules, encoding_name):
    total = 0
    if isinstance(schema.get("enum"), list):
        total += rules["enum"] + sum(rules["enum_item"] + text_tokens(str(item), encoding_name) for item in schema["enum"])
    return total + text_tokens(f"{name}:{schema.get('type', '')}:{without_period(schema.get('description'))}", encoding_name)


def as_dict(value):
    """A schema part that is not an object adds nothing (the vendor would refuse it anyway)."""
    return value if isinstance(value, dict) else {}


def without_period(text):
    text = text if isinstance(text, str) else ""
    return text[:-1] if text.endswith(".") else text
