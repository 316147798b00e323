import unittest

from textutil import slugify


class TestSlugify(unittest.TestCase):
    def test_words(self):
        self.assertEqual(slugify("Hello World"), "hello-world")

    def test_already_slug(self):
        self.assertEqual(slugify("already-a-slug"), "already-a-slug")

    def test_empty(self):
        self.assertEqual(slugify(""), "")

    def test_punctuation_dropped(self):
        self.assertEqual(slugify("Hello, World!"), "hello-world")

    def test_outer_spaces_stripped(self):
        self.assertEqual(slugify("  Leading and trailing  "), "leading-and-trailing")

    def test_repeated_separators_collapse(self):
        self.assertEqual(slugify("multiple   spaces"), "multiple-spaces")

    def test_underscores_and_dashes(self):
        self.assertEqual(slugify("under_score -- and-dash"), "under-score-and-dash")

    def test_accents_removed(self):
        self.assertEqual(slugify("Crème Brûlée"), "creme-brulee")

    def test_digits_kept(self):
        self.assertEqual(slugify("Version 2.0"), "version-2-0")

    def test_only_separators(self):
        self.assertEqual(slugify("--- !!! ___"), "")


if __name__ == "__main__":
    unittest.main()
