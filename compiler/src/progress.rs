//! Progress of a compile on the terminal: one line per stage (import, fusion per bucket, kernel
//! generation, ptxas, weights with bytes and rate) drawn by `indicatif` on standard error, and
//! nothing at all when standard error is not a terminal or `--quiet` is given.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

/// The stages of one compile.
pub struct Progress {
    bars: Option<MultiProgress>,
}

/// One stage's line; finished (left on screen with its time) when dropped.
pub struct Stage {
    bar: ProgressBar,
}

impl Progress {
    /// Progress on standard error when it is a terminal and `quiet` is false.
    pub fn new(quiet: bool) -> Progress {
        Progress::shown(!quiet && std::io::stderr().is_terminal())
    }

    /// Progress drawn (`true`) or not.
    pub fn shown(shown: bool) -> Progress {
        let bars = shown.then(|| MultiProgress::with_draw_target(ProgressDrawTarget::stderr()));
        Progress { bars }
    }

    /// A stage of `len` steps (`{pos}/{len}`), or of unknown length when `len` is 0 (a spinner).
    pub fn stage(&self, name: &str, len: u64) -> Stage {
        let template = if len == 0 {
            "{spinner} {prefix:<10} {msg} {elapsed:.dim}"
        } else {
            "{spinner} {prefix:<10} [{bar:30}] {pos}/{len} {msg} {elapsed:.dim}"
        };
        self.add(name, len, template)
    }

    /// A stage that moves `len` bytes, shown with its rate and the time left.
    pub fn bytes(&self, name: &str, len: u64) -> Stage {
        self.add(
            name,
            len,
            "{spinner} {prefix:<10} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta} {msg}",
        )
    }

    fn add(&self, name: &str, len: u64, template: &str) -> Stage {
        let Some(bars) = &self.bars else {
            return Stage {
                bar: ProgressBar::hidden(),
            };
        };
        let style = ProgressStyle::with_template(template)
            .expect("the templates are valid")
            .progress_chars("=> ");
        let bar = bars.add(ProgressBar::new(len).with_style(style));
        bar.set_prefix(name.to_string());
        bar.enable_steady_tick(Duration::from_millis(100));
        Stage { bar }
    }
}

impl Stage {
    /// Advances by `n` steps (or bytes).
    pub fn inc(&self, n: u64) {
        self.bar.inc(n);
    }

    /// Says what the stage is doing now.
    pub fn say(&self, message: impl Into<String>) {
        self.bar.set_message(message.into());
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        self.bar.finish();
    }
}
