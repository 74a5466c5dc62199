"""Text: tokenizer, chat templates, stop strings and the text worker that turns tokens into frames."""
