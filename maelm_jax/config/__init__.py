"""The config language, plain data that imports no model code: fields with their types,
ranges and rules (schema), the models' named choices (options), the sections several
config kinds share (sections) and named variants of a config file."""
