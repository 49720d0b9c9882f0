//! Entitlement: what each tenant was owed of the GPU time that was used, by weighted
//! max-min fairness (water-filling) over its measured demand. A tenant that does not use
//! its weighted share is not owed it: it is entitled to what it used, and what it left is
//! split among the others by weight; a tenant that wanted more than it got (the
//! scheduler held it back) has unbounded demand. Pure: [`max_min`] is driven by tests.

/// One claimant: its weight and its demand (`None`: as much as it can get).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Claim {
    pub weight: u32,
    pub demand: Option<f64>,
}

/// Splits `capacity` among `claims` by weighted max-min fairness: no claimant gets more
/// than its demand, and capacity that a claimant with a bounded demand leaves goes to the
/// others in proportion to their weights. Returns each claimant's entitlement, in order.
/// When every demand is bounded and they add up to less than `capacity`, the rest is
/// left unassigned.
pub fn max_min(capacity: f64, claims: &[Claim]) -> Vec<f64> {
    let mut out = vec![0.0; claims.len()];
    let mut open: Vec<usize> = (0..claims.len()).collect();
    let mut left = capacity.max(0.0);
    while !open.is_empty() && left > 0.0 {
        let w: f64 = open
            .iter()
            .map(|&i| f64::from(claims[i].weight.max(1)))
            .sum();
        let unit = left / w;
        // Claimants whose remaining demand fits in their weighted part are satisfied.
        let (done, rest): (Vec<usize>, Vec<usize>) = open.iter().partition(|&&i| {
            claims[i]
                .demand
                .is_some_and(|d| d - out[i] <= unit * f64::from(claims[i].weight.max(1)))
        });
        if done.is_empty() {
            for &i in &rest {
                out[i] += unit * f64::from(claims[i].weight.max(1));
            }
            break;
        }
        for &i in &done {
            let d = claims[i].demand.unwrap_or(0.0);
            left -= (d - out[i]).max(0.0);
            out[i] = d.max(out[i]);
        }
        open = rest;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(weight: u32, demand: Option<f64>) -> Claim {
        Claim { weight, demand }
    }

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-9)
    }

    #[test]
    fn unbounded_claimants_split_by_weight() {
        let e = max_min(100.0, &[c(1, None), c(3, None)]);
        assert!(close(&e, &[25.0, 75.0]), "{e:?}");
    }

    #[test]
    fn a_light_tenant_gets_its_demand_and_the_rest_is_shared() {
        // The demo: vm4 uses 10 %, the three others split the rest equally.
        let e = max_min(
            100.0,
            &[c(100, None), c(100, None), c(100, None), c(100, Some(10.0))],
        );
        assert!(close(&e, &[30.0, 30.0, 30.0, 10.0]), "{e:?}");
        // After vm2's weight goes to 400: 90 split 1:4:1.
        let e = max_min(
            100.0,
            &[c(100, None), c(400, None), c(100, None), c(100, Some(10.0))],
        );
        assert!(close(&e, &[15.0, 60.0, 15.0, 10.0]), "{e:?}");
    }

    #[test]
    fn satisfied_claimants_cascade() {
        // 2 is below its share, then 3 becomes below the new share.
        let e = max_min(90.0, &[c(1, None), c(1, Some(10.0)), c(1, Some(35.0))]);
        assert!(close(&e, &[45.0, 10.0, 35.0]), "{e:?}");
    }

    #[test]
    fn bounded_demands_below_capacity_get_exactly_their_demand() {
        let e = max_min(100.0, &[c(1, Some(20.0)), c(5, Some(30.0))]);
        assert!(close(&e, &[20.0, 30.0]), "{e:?}");
        assert!(max_min(100.0, &[]).is_empty());
        assert!(close(&max_min(0.0, &[c(1, None)]), &[0.0]));
    }
}
