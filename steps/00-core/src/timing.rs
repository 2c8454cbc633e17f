//! The one timing loop: warm up, then the median of timed runs. A CPU method is timed by
//! the process's monotonic clock around the call; a GPU method brings its own clock (events
//! recorded on its stream) and hands this loop one measured time per run.

use std::time::Instant;

/// The median of `xs` (the mean of the middle two for an even count); `NaN` for none.
pub fn median(mut xs: Vec<f64>) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// How long to warm up before the timed runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Warmup {
    /// This many untimed calls (the CPU: page in the code, fill the allocator, start the
    /// pool).
    Calls(usize),
    /// Calls until their measured times add up to this many milliseconds (a GPU: its clocks
    /// leave their idle state only after some work, so the first run would be the slowest).
    Millis(f64),
}

/// The median milliseconds of `runs` runs after the warm-up, where `once` runs the thing
/// measured once and returns how long it took, in milliseconds, by its own clock.
pub fn median_ms<E>(
    warmup: Warmup,
    runs: usize,
    mut once: impl FnMut() -> Result<f64, E>,
) -> Result<f64, E> {
    match warmup {
        Warmup::Calls(n) => {
            for _ in 0..n {
                once()?;
            }
        }
        Warmup::Millis(ms) => {
            let mut warm = 0.0;
            while warm < ms {
                // a run that measures as 0 still counts, so the loop ends
                warm += once()?.max(0.01);
            }
        }
    }
    let times = (0..runs.max(1))
        .map(|_| once())
        .collect::<Result<Vec<_>, _>>()?;
    Ok(median(times))
}

/// Times `call` on this thread's clock: the warm-up, then the median of `runs`. Whatever
/// `call` returns is dropped after its clock stops: freeing a result is not part of the
/// call.
pub fn cpu_median_ms<T, E>(
    warmup: Warmup,
    runs: usize,
    call: impl FnMut() -> Result<T, E>,
) -> Result<f64, E> {
    median_ms(warmup, runs, on_cpu_clock(call))
}

/// `call` as a run that measures itself on this thread's clock, in milliseconds, for
/// [`median_ms`] or [`medians_in_turn`]; what it returns is dropped after the clock stops.
pub fn on_cpu_clock<T, E>(
    mut call: impl FnMut() -> Result<T, E>,
) -> impl FnMut() -> Result<f64, E> {
    move || {
        let start = Instant::now();
        let result = call();
        let ms = start.elapsed().as_secs_f64() * 1e3;
        drop(result?);
        Ok(ms)
    }
}

/// A run that measures itself, in milliseconds ([`on_cpu_clock`]).
pub type Run<'a, E> = Box<dyn FnMut() -> Result<f64, E> + 'a>;

/// The median milliseconds of each of `runs`, timed in turn: each one's `warmup` calls,
/// then `times` rounds that call each once, in order. A slow spell of a machine shared with
/// others falls on all of them alike, so their ratios hold better than when each is timed
/// in a block of its own.
pub fn medians_in_turn<E>(
    warmup: usize,
    times: usize,
    runs: &mut [Run<'_, E>],
) -> Result<Vec<f64>, E> {
    for run in runs.iter_mut() {
        for _ in 0..warmup {
            run()?;
        }
    }
    let mut each = vec![Vec::with_capacity(times.max(1)); runs.len()];
    for _ in 0..times.max(1) {
        for (run, ms) in runs.iter_mut().zip(&mut each) {
            ms.push(run()?);
        }
    }
    Ok(each.into_iter().map(median).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(vec![5.0, 1.0, 3.0]), 3.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(vec![]).is_nan());
    }

    #[test]
    fn warm_up_then_time() {
        let mut calls = 0;
        let ms = median_ms(Warmup::Calls(2), 3, || {
            calls += 1;
            Ok::<_, ()>(calls as f64)
        });
        // calls 1 and 2 warm up; 3, 4 and 5 are timed
        assert_eq!((ms, calls), (Ok(4.0), 5));
        let mut calls = 0;
        let ms = median_ms(Warmup::Millis(10.0), 1, || {
            calls += 1;
            Ok::<_, ()>(4.0)
        });
        // three runs of 4 ms pass 10 ms of warm-up, the fourth is timed
        assert_eq!((ms, calls), (Ok(4.0), 4));
    }

    #[test]
    fn runs_in_turn_each_get_their_own_median() {
        let order = std::cell::RefCell::new(Vec::new());
        let run = |name: char, ms: [f64; 4]| -> Run<'_, ()> {
            let (order, mut i) = (&order, 0);
            Box::new(move || {
                order.borrow_mut().push(name);
                i += 1;
                Ok(ms[i - 1])
            })
        };
        // one warm-up call each, a then b, then three rounds of a, b in turn
        let mut runs = [
            run('a', [9.0, 1.0, 5.0, 3.0]),
            run('b', [9.0, 2.0, 2.0, 7.0]),
        ];
        let ms = medians_in_turn(1, 3, &mut runs);
        drop(runs);
        assert_eq!(ms, Ok(vec![3.0, 2.0]));
        assert_eq!(order.into_inner(), "abababab".chars().collect::<Vec<_>>());
    }

    #[test]
    fn an_error_stops_the_loop() {
        let r = cpu_median_ms(Warmup::Calls(1), 5, || Err::<(), _>("no"));
        assert_eq!(r, Err("no"));
    }
}
