"""The schedule language's statements, one module each (or a few that share a meaning): the
statement's grammar rules, its AST node and the builder that makes one from the parse tree.
`mkc.lang.syntax` finds every module here; adding one adds a statement to the language."""
