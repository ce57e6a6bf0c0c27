"""Draft vocabularies: the drafter's LM head over all rows, a fixed subset (FR-Spec's corpus
frequencies, VocabTrim's target-generated ones) or one chosen each step (SpecVocab), and the
token maps they read."""
